"""A tiny FluxKontextPipeline: FLUX.1 Kontext [dev]'s layout is FLUX.1 [dev]'s (the same MMDiT with a guidance
embedding, CLIP + T5, the VAE, flow matching with dynamic shift), so the tiny FLUX parts serve it as they are.

An instruction edit appends the input image's packed latents (position ids with first axis 1) to the image
tokens: 64x64 → 256 output + 256 conditioning image tokens + 512 T5 tokens.
"""

from __future__ import annotations


def build(seed: int):
    from diffusers import FluxKontextPipeline

    from stage_runtime.models.tiny import flux

    return FluxKontextPipeline(**flux.build(seed).components)
