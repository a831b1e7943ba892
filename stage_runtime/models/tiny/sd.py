"""A tiny StableDiffusionPipeline (SD-1.x layout): CLIP text encoder, a 4-head UNet, the tiny VAE, DDIM."""

from __future__ import annotations

from stage_runtime.models.tiny.common import ddim_scheduler, seeded, tiny_clip_text_encoder, tiny_unet, tiny_vae


def build(seed: int):
    """Assemble a tiny StableDiffusionPipeline; each component gets its own derived seed."""
    from diffusers import StableDiffusionPipeline

    from stage_runtime.models.tiny.clip_tokenizer import build_clip_tokenizer

    tokenizer = build_clip_tokenizer()
    return StableDiffusionPipeline(
        vae=seeded(seed, tiny_vae),
        text_encoder=seeded(seed + 1, lambda: tiny_clip_text_encoder(tokenizer)),
        tokenizer=tokenizer,
        unet=seeded(seed + 2, tiny_unet),
        scheduler=ddim_scheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
