"""A tiny StableDiffusionPipeline (SD-1.x layout): CLIP text encoder, a 4-head UNet, the tiny VAE, DDIM."""

from __future__ import annotations

from stage_runtime.models.tiny.common import HIDDEN, LATENT_CHANNELS, NUM_HEADS, ddim_scheduler, seeded, tiny_clip_text_encoder, tiny_vae


def _tiny_unet():
    """UNet2DConditionModel on 32x32 latents with 4-head (self and cross) attention.

    Channels are 16/32; attention only lives at the 32-channel level (down, mid, up),
    so every attention layer has 4 heads of dim 8, like the text encoder and DiT.

    Note: in ``UNet2DConditionModel`` ``attention_head_dim`` is historically the
    *number of heads* (see diffusers issue #2011), so 4 here means 4 heads per layer.
    """
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=32,
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(16, 32),
        layers_per_block=1,
        norm_num_groups=8,
        cross_attention_dim=HIDDEN,
        attention_head_dim=NUM_HEADS,
    )


def build(seed: int):
    """Assemble a tiny StableDiffusionPipeline; each component gets its own derived seed."""
    from diffusers import StableDiffusionPipeline

    from stage_runtime.models.tiny.clip_tokenizer import build_clip_tokenizer

    tokenizer = build_clip_tokenizer()
    return StableDiffusionPipeline(
        vae=seeded(seed, tiny_vae),
        text_encoder=seeded(seed + 1, lambda: tiny_clip_text_encoder(tokenizer)),
        tokenizer=tokenizer,
        unet=seeded(seed + 2, _tiny_unet),
        scheduler=ddim_scheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
