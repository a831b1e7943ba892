"""A tiny HunyuanVideo15Pipeline (HunyuanVideo-1.5 T2V): a 1-block dual-stream transformer (2 heads of 8, a
1-layer token refiner), a tiny Qwen2.5-VL text model (2 layers, hidden 16, 2 heads) with the tiny Qwen2 BPE
tokenizer, the tiny T5 encoder on transformers' built-in ``ByT5Tokenizer()`` (bytes: no vocabulary file), the
causal HunyuanVideo-1.5 VAE (spatial x4, temporal x4), flow-matching Euler (shift 7) and a
``ClassifierFreeGuidance`` guider (scale 6).

Facts for the adapter (diffusers 0.42.1 ``pipeline_hunyuan_video1_5.py``):
- no ``guidance_scale`` argument: guidance is the ``guider`` component's (``pipe.guider.guidance_scale``; exactly
  1.0 turns CFG off: one transformer row a step instead of two). Default call: ``num_frames`` 121, 50 steps,
  ``output_type="np"``; without height and width, the 16:9 bucket nearest ``transformer.config.target_size``
  (16 here: 12x20).
- size: no check; latents are ``H // 4`` x ``W // 4`` (the real VAE: // 16), so use multiples of 4 (16 for the
  real model); frames: latent frames ``(F - 1) // 4 + 1`` and the VAE decodes ``4 (T - 1) + 1``, so a count that
  is not ``4k + 1`` silently comes back shorter (10 -> 9).
- latents: 4 channels (real: 32); the transformer takes 9 = latents + conditioning latents + mask (real: 65).
- text: the Qwen prompt goes through the chat template; the pipeline crops the first 108 tokens (the system
  message and the user header: exactly 108 with this tokenizer too) and keeps 1000 (padded); the
  ByT5 prompt is only the quoted text of the prompt (zeros and mask 0 when there is none) padded to 256,
  plus 729 image tokens (zero and masked out for T2V): 1985 context tokens per CFG branch.
  Video tokens = latent frames x H/4 x W/4 (16x16x9 -> 48). fps 24 (diffusers' example writes 15).
- size on disk: about 17.8 MB, not a few hundred KB: the transformer's ByT5 projection has a fixed 2048-wide
  hidden layer (``HunyuanVideo15ByT5TextProjection(text_embed_2_dim, 2048, inner_dim)``: 4.2 M parameters)
  whatever the config says.
"""

from __future__ import annotations

from stage_runtime.models.tiny.common import flow_match_euler, seeded
from stage_runtime.models.tiny.t5_tokenizer import T5_HIDDEN, tiny_t5_encoder

TEXT_HIDDEN = 16
IMAGE_EMBED_DIM = 8          # the image tokens' width (SigLIP's hidden size in image-to-video)
LATENT_CHANNELS = 4
GUIDANCE_SCALE = 6.0
SHIFT = 7.0
# The words of the pipeline's system message (and its runs of 8 spaces) as one token each, as in the real
# vocabulary: the chat-template prefix before the prompt is then exactly the 108 tokens the pipeline crops.
SYSTEM_WORDS = tuple("You helpful video following aspects The main content theme Actions events behaviors "
                     "temporal physical movement changes environment atmosphere camera angles movements transitions "
                     "used".split())
SPACE_RUNS = (" ", " " * 3, " " * 7)


def tiny_transformer(**config):
    """HunyuanVideo15Transformer3DModel: 1 block, 2 heads of 8, patch 1, RoPE axes 2/2/4, T2V (``config`` overrides:
    image-to-video's ``task_type``)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    layout = dict(
        in_channels=2 * LATENT_CHANNELS + 1, out_channels=LATENT_CHANNELS, num_attention_heads=2,
        attention_head_dim=8, num_layers=1, num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1,
        text_embed_dim=TEXT_HIDDEN, text_embed_2_dim=T5_HIDDEN, image_embed_dim=IMAGE_EMBED_DIM,
        rope_axes_dim=(2, 2, 4), target_size=16, task_type="t2v")
    return HunyuanVideo15Transformer3DModel(**{**layout, **config})


def _tiny_vae():
    """AutoencoderKLHunyuanVideo15: two 8-channel levels, both down- and upsampling in space and time."""
    from diffusers import AutoencoderKLHunyuanVideo15

    return AutoencoderKLHunyuanVideo15(
        in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS, block_out_channels=(8, 8),
        layers_per_block=1, spatial_compression_ratio=4, temporal_compression_ratio=4,
        downsample_match_channel=False, upsample_match_channel=False)


def _tiny_text_encoder(tokenizer):
    """Qwen2_5_VLTextModel: 2 layers, hidden 16, 2 heads (and 2 key/value heads) of 8."""
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    return Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer), hidden_size=TEXT_HIDDEN, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048, rope_theta=1000000.0,
        rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))


def components(seed: int, **transformer_config) -> dict:
    """The pipeline's components, each seeded (``transformer_config``: :func:`tiny_transformer`'s overrides)."""
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer

    from stage_runtime.models.tiny.qwen2_tokenizer import build_qwen2_tokenizer

    tokenizer, byt5_tokenizer = build_qwen2_tokenizer(SYSTEM_WORDS + SPACE_RUNS), ByT5Tokenizer()
    return {"text_encoder": seeded(seed + 1, lambda: _tiny_text_encoder(tokenizer)), "tokenizer": tokenizer,
            "transformer": seeded(seed + 2, lambda: tiny_transformer(**transformer_config)),
            "vae": seeded(seed, _tiny_vae), "scheduler": flow_match_euler(SHIFT),
            "text_encoder_2": seeded(seed + 3, lambda: tiny_t5_encoder(byt5_tokenizer)), "tokenizer_2": byt5_tokenizer,
            "guider": ClassifierFreeGuidance(guidance_scale=GUIDANCE_SCALE)}


def build(seed: int):
    from diffusers import HunyuanVideo15Pipeline

    return HunyuanVideo15Pipeline(**components(seed))
