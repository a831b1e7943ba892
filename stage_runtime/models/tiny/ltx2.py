"""A tiny LTX2Pipeline (LTX-2: video with sound): a 2-layer audio-video transformer (video 2 heads of 8, audio
2 heads of 4), a tiny Gemma 3 text encoder (2 layers, hidden 32, 2 heads; a 1-layer SigLIP tower the
pipeline never runs) with the tiny Gemma tokenizer, the text connectors (1 layer per stream, 4 heads of 8),
the LTX-2 video VAE with the real compression (spatial x32 by a 4x4 patch and three 2x levels, temporal x8),
the LTX-2 audio VAE (mel spectrogram latents) and a vocoder whose upsampling (160) equals the mel hop, so the
waveform is real-time at 16 kHz; flow-matching Euler with LTX-Video's dynamic shift.

Facts for the adapter (diffusers 0.42.1 ``pipeline_ltx2.py``):
- output: ``.frames`` (``(B, F, H, W, 3)`` for ``output_type="np"``) and ``.audio``, always a torch tensor
  ``(B, 2, samples)`` at ``pipe.vocoder.config.output_sampling_rate`` (16000 here): about ``F / frame_rate`` s.
- size: height and width multiples of 32 (``ValueError`` otherwise), and at least 64: a 32-pixel side is one
  latent pixel, which the VAE decoder's reflect padding (the class default) cannot pad (``RuntimeError``).
- frames: latent frames ``(F - 1) // 8 + 1``, so use ``(F - 1) % 8 == 0`` (9, 17, ...); default 121.
- latents: 8 video channels (real: 128), VAE spatial x32, temporal x8: video tokens = latent frames x H/32 x
  W/32 (64x64x9 -> 8, 64x64x17 -> 12); audio tokens: about 25 per second of video (16 kHz / hop 160 / 4).
- text: ``max_sequence_length`` 1024 (default; left-padded, ``<bos>`` first); every hidden state of the text
  encoder is stacked, so the connectors take 3 x 32 per token.
- call: 512x768, 30 steps, ``frame_rate`` 24.0 (the default fps), ``output_type="pil"`` by default. Guidance:
  with the defaults (``guidance_scale`` 3, ``stg_scale`` 1, ``modality_scale`` 3 and their audio twins) a step
  runs the transformer 3 times on 4 rows (the CFG pair, an STG-perturbed row, a modality-isolated row); with
  ``guidance_scale`` 1, ``stg_scale`` 0, ``modality_scale`` 1 (and the audio ones) once on 1 row.
- about 805 KB on disk.
"""

from __future__ import annotations

from stage_runtime.models.tiny.common import flow_match_euler, seeded

TEXT_HIDDEN, TEXT_LAYERS = 32, 2
LATENT_CHANNELS = 8
SPATIAL, TEMPORAL = 32, 8
AUDIO_RATE, MEL_HOP, MEL_BINS, AUDIO_LATENT_CHANNELS = 16000, 160, 8, 2
CONNECTOR_HEADS, CONNECTOR_HEAD_DIM = 4, 8
# LTX-Video's flow-matching shift: from the video token count, exponential, ending at 0.1.
DYNAMIC_SHIFT = {"use_dynamic_shifting": True, "base_shift": 0.95, "max_shift": 2.05, "base_image_seq_len": 1024,
                 "max_image_seq_len": 4096, "shift_terminal": 0.1, "time_shift_type": "exponential"}


def _tiny_text_encoder(tokenizer):
    """Gemma3ForConditionalGeneration: 2 text layers (hidden 32, 2 heads and 2 key/value heads of 16), a
    1-layer SigLIP vision tower (16x16 images in 8x8 patches, 4 image tokens)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    config = Gemma3Config(
        text_config={"vocab_size": len(tokenizer), "hidden_size": TEXT_HIDDEN, "intermediate_size": 37,
                     "num_hidden_layers": TEXT_LAYERS, "num_attention_heads": 2, "num_key_value_heads": 2,
                     "head_dim": 16, "query_pre_attn_scalar": 16, "max_position_embeddings": 2048,
                     "sliding_window": 512, "pad_token_id": tokenizer.pad_token_id,
                     "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id},
        vision_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 16, "patch_size": 8},
        mm_tokens_per_image=4, boi_token_index=ids("<start_of_image>"), eoi_token_index=ids("<end_of_image>"),
        image_token_index=ids("<image_soft_token>"), pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return Gemma3ForConditionalGeneration(config)


def _tiny_connectors():
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    stream = {"num_attention_heads": CONNECTOR_HEADS, "attention_head_dim": CONNECTOR_HEAD_DIM, "num_layers": 1,
              "num_learnable_registers": None}
    return LTX2TextConnectors(
        caption_channels=TEXT_HIDDEN, text_proj_in_factor=TEXT_LAYERS + 1,
        **{f"{kind}_connector_{key}": value for kind in ("video", "audio") for key, value in stream.items()},
        connector_rope_base_seq_len=32, rope_double_precision=False, rope_type="split")


def _tiny_transformer():
    from diffusers import LTX2VideoTransformer3DModel

    return LTX2VideoTransformer3DModel(
        in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, patch_size=1, patch_size_t=1,
        num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        vae_scale_factors=(TEMPORAL, SPATIAL, SPATIAL), audio_in_channels=AUDIO_LATENT_CHANNELS * MEL_BINS // 4,
        audio_out_channels=AUDIO_LATENT_CHANNELS * MEL_BINS // 4, audio_num_attention_heads=2,
        audio_attention_head_dim=4, audio_cross_attention_dim=8,
        audio_sampling_rate=AUDIO_RATE, audio_hop_length=MEL_HOP, num_layers=2, caption_channels=TEXT_HIDDEN,
        rope_double_precision=False, rope_type="split")


def _tiny_vae():
    """AutoencoderKLLTX2Video: 4 channels at every level; 4x4 patches, then spatial, temporal and two
    spatio-temporal 2x levels (x32 / x8, as the real VAE); the decoder mirrors them with three 2x levels."""
    from diffusers import AutoencoderKLLTX2Video

    return AutoencoderKLLTX2Video(
        latent_channels=LATENT_CHANNELS, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(4, 4, 4),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
        downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
        upsample_residual=(False, False, False), upsample_factor=(1, 1, 1), patch_size=4,
        decoder_causal=False, spatial_compression_ratio=SPATIAL, temporal_compression_ratio=TEMPORAL)


def _tiny_audio_vae():
    from diffusers import AutoencoderKLLTX2Audio

    return AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=AUDIO_LATENT_CHANNELS, norm_type="pixel", causality_axis="height",
        dropout=0.0, mid_block_add_attention=False, sample_rate=AUDIO_RATE, mel_hop_length=MEL_HOP,
        is_causal=True, mel_bins=MEL_BINS)


def _tiny_vocoder():
    """LTX2Vocoder: mel frames to a stereo waveform, upsampling 5 x 4 x 8 = 160 (the mel hop)."""
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    return LTX2Vocoder(
        in_channels=2 * MEL_BINS, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[10, 8, 16],
        upsample_factors=[5, 4, 8], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3]],
        output_sampling_rate=AUDIO_RATE)


def build(seed: int):
    from diffusers import LTX2Pipeline

    from stage_runtime.models.tiny.gemma_tokenizer import build_gemma_tokenizer

    tokenizer = build_gemma_tokenizer()
    return LTX2Pipeline(
        scheduler=flow_match_euler(1.0, **DYNAMIC_SHIFT),
        vae=seeded(seed, _tiny_vae),
        audio_vae=seeded(seed + 4, _tiny_audio_vae),
        text_encoder=seeded(seed + 1, lambda: _tiny_text_encoder(tokenizer)),
        tokenizer=tokenizer,
        connectors=seeded(seed + 3, _tiny_connectors),
        transformer=seeded(seed + 2, _tiny_transformer),
        vocoder=seeded(seed + 5, _tiny_vocoder),
    )
