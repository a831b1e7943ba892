"""A tiny class-conditional DiTPipeline: a 2-layer, 4-head DiT transformer, the tiny VAE, DDIM."""

from __future__ import annotations

from stage_runtime.models.tiny.common import HIDDEN, LATENT_CHANNELS, NUM_CLASSES, NUM_HEADS, ddim_scheduler, seeded, tiny_vae


def _tiny_dit_transformer():
    """DiTTransformer2DModel: 32x32 latents, patch 2, 2 layers, 4 heads x 8, learned sigma."""
    from diffusers import DiTTransformer2DModel

    return DiTTransformer2DModel(
        num_attention_heads=NUM_HEADS,
        attention_head_dim=HIDDEN // NUM_HEADS,
        in_channels=LATENT_CHANNELS,
        out_channels=2 * LATENT_CHANNELS,  # eps + learned variance, split off by DiTPipeline
        num_layers=2,
        sample_size=32,
        patch_size=2,
        num_embeds_ada_norm=NUM_CLASSES,  # +1 embedding row for the null class (id 1000)
        norm_type="ada_norm_zero",
    )


def build(seed: int):
    """Assemble a tiny DiTPipeline (``id2label`` is not persisted by diffusers, so none is set)."""
    from diffusers import DiTPipeline

    return DiTPipeline(
        transformer=seeded(seed + 2, _tiny_dit_transformer),
        vae=seeded(seed, tiny_vae),
        scheduler=ddim_scheduler(),
    )
