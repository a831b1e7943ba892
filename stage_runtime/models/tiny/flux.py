"""A tiny FluxPipeline (FLUX.1 layout): CLIP + T5 text encoders, a 1 double + 1 single block MMDiT with
2 heads of 16 and a guidance embedding (FLUX.1-dev style), the tiny VAE, flow matching with dynamic shift.

64x64 images: VAE factor 2 → 32x32x4 latents, packed 2x2 → 256 image tokens of 16 channels; the T5
prompt keeps 512 tokens, so the joint sequence is 768 tokens (both divisible by 2 for Ulysses).
"""

from __future__ import annotations

from stage_runtime.models.tiny.common import HIDDEN, LATENT_CHANNELS, seeded, tiny_clip_text_encoder, tiny_vae
from stage_runtime.models.tiny.t5_tokenizer import T5_HIDDEN, build_t5_tokenizer, tiny_t5_encoder

HEADS, HEAD_DIM = 2, 16
# FLUX.1's VAE normalisation (latents = (z - shift) * scale): exercised, not the identity.
VAE_SCALING, VAE_SHIFT = 0.3611, 0.1159


def flow_match_scheduler(dynamic_shift: bool):
    """FlowMatchEulerDiscreteScheduler: FLUX.1-dev's dynamic shift (mu from the image sequence length) or
    SD3's static shift 3."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if dynamic_shift:
        return FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                               base_image_seq_len=256, max_image_seq_len=4096)
    return FlowMatchEulerDiscreteScheduler(shift=3.0)


def flow_vae():
    """The tiny VAE with a non-trivial scaling and shift factor (flow-matching families decode (z/s)+shift)."""
    vae = tiny_vae()
    vae.register_to_config(scaling_factor=VAE_SCALING, shift_factor=VAE_SHIFT)
    return vae


def _tiny_flux_transformer():
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * LATENT_CHANNELS,          # 2x2 packed latents
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        joint_attention_dim=T5_HIDDEN,
        pooled_projection_dim=HIDDEN,             # CLIP's pooled output
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),                 # sums to the head dim
    )


def build(seed: int):
    from diffusers import FluxPipeline

    from stage_runtime.models.tiny.clip_tokenizer import build_clip_tokenizer

    clip_tokenizer, t5_tokenizer = build_clip_tokenizer(), build_t5_tokenizer()
    return FluxPipeline(
        scheduler=flow_match_scheduler(dynamic_shift=True),
        vae=seeded(seed, flow_vae),
        text_encoder=seeded(seed + 1, lambda: tiny_clip_text_encoder(clip_tokenizer)),
        tokenizer=clip_tokenizer,
        text_encoder_2=seeded(seed + 3, lambda: tiny_t5_encoder(t5_tokenizer)),
        tokenizer_2=t5_tokenizer,
        transformer=seeded(seed + 2, _tiny_flux_transformer),
    )
