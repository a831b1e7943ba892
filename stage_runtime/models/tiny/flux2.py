"""A tiny Flux2Pipeline (FLUX.2 [dev] layout): a Mistral 3 text encoder (30 layers of hidden 16: the pipeline
stacks the hidden states of layers 10, 20 and 30, so the transformer's text width is 48), the tiny Mistral
tokenizer (``mistral_tokenizer``), a 1 double + 2 single block Flux2 transformer (4 heads of 8, a guidance
embedding: guidance-distilled like [dev]), the Flux2 VAE with a batch-norm over its patchified latents, and
flow-matching Euler with FLUX.2's dynamic shift.

64x64 images: VAE factor 2 → 32x32x4 latents, patchified 2x2 → 16x16x16 → 256 image tokens of 16 channels; the
prompt keeps 512 tokens (the pipeline's ``max_sequence_length``), so the joint sequence is 768 tokens.
``flux2_klein`` shares the transformer, VAE and scheduler (its own text encoder: Qwen3).
"""

from __future__ import annotations

from stage_runtime.models.tiny.common import seeded

HEADS, HEAD_DIM = 4, 8
# diffusers' default init leaves the blocks' modulation gates near 0.04 in so small a model: every block then adds
# almost nothing to the image tokens and the output hardly depends on the prompt or the guidance (1-2 uint8). The
# modulation weights are scaled up so the gates are O(1): a prompt or guidance scale then changes the image by tens.
MODULATION_GAIN = 25.0
LATENT_CHANNELS = 4
TEXT_HIDDEN = 16
TEXT_WIDTH = 3 * TEXT_HIDDEN                 # three stacked hidden-state layers


def tiny_flux2_transformer(guidance_embeds: bool):
    """Flux2Transformer2DModel: 2x2-patchified latents (16 channels), 1 double + 2 single blocks, 4 heads of 8;
    ``guidance_embeds`` for [dev] (a guidance-distilled model), none for Klein (real CFG)."""
    import torch
    from diffusers import Flux2Transformer2DModel

    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=1, num_single_layers=2,
        attention_head_dim=HEAD_DIM, num_attention_heads=HEADS, joint_attention_dim=TEXT_WIDTH,
        timestep_guidance_channels=32, axes_dims_rope=(2, 2, 2, 2), guidance_embeds=guidance_embeds,
    )
    with torch.no_grad():
        for modulation in (transformer.double_stream_modulation_img, transformer.double_stream_modulation_txt,
                           transformer.single_stream_modulation):
            modulation.linear.weight.mul_(MODULATION_GAIN)
    return transformer


def tiny_flux2_vae():
    """AutoencoderKLFlux2 with two 16/32-channel levels (2x downsampling, 4 latent channels) and non-trivial
    batch-norm statistics over the 16 patchified channels (the pipeline decodes ``z * std + mean``)."""
    import torch
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(16, 32), layers_per_block=1,
        latent_channels=LATENT_CHANNELS, norm_num_groups=8, sample_size=64,
    )
    channels = vae.bn.num_features
    vae.bn.running_mean.copy_(torch.linspace(-0.2, 0.2, channels))
    vae.bn.running_var.copy_(torch.linspace(0.5, 1.5, channels))
    return vae


def flux2_scheduler():
    """FlowMatchEulerDiscreteScheduler as FLUX.2 ships it (dynamic shift: ``mu`` from the image tokens and steps)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                           base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                           max_image_seq_len=4096)


def _tiny_text_encoder(tokenizer):
    """Mistral3ForConditionalGeneration: 30 text layers (hidden 16, 2 heads of 8, 1 kv head), a 1-layer Pixtral
    vision tower (never called: prompts only)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    config = Mistral3Config(
        text_config={"model_type": "mistral", "hidden_size": TEXT_HIDDEN, "intermediate_size": 32,
                     "num_hidden_layers": 30, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
                     "vocab_size": len(tokenizer), "max_position_embeddings": 2048, "sliding_window": None,
                     "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
                     "eos_token_id": tokenizer.eos_token_id},
        vision_config={"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "head_dim": 8, "image_size": 32, "patch_size": 8},
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2,
    )
    return Mistral3ForConditionalGeneration(config)


def build(seed: int):
    from diffusers import Flux2Pipeline

    from stage_runtime.models.tiny.mistral_tokenizer import build_mistral_tokenizer

    tokenizer = build_mistral_tokenizer()
    return Flux2Pipeline(
        scheduler=flux2_scheduler(),
        vae=seeded(seed, tiny_flux2_vae),
        text_encoder=seeded(seed + 1, lambda: _tiny_text_encoder(tokenizer)),
        tokenizer=tokenizer,
        transformer=seeded(seed + 2, lambda: tiny_flux2_transformer(guidance_embeds=True)),
    )
