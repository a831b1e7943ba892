"""Build tiny, randomly initialised (but seeded) diffusers pipelines for tests and demos.

``make_tiny_model(out_dir, kind)`` writes a real pipeline folder with ``save_pretrained``
that loads back with ``DiffusionPipeline.from_pretrained(out_dir, local_files_only=True)``.
Nothing is downloaded. Both kinds produce 64x64 images by default (VAE downsample 2,
32x32 latents with 4 channels); every attention layer has 4 heads so sequence-parallel
schemes that split heads 2- or 4-ways work.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

KINDS = ("sd", "dit")

HIDDEN = 32  # text hidden size == UNet cross-attention dim == DiT inner dim (4 heads x 8)
NUM_HEADS = 4
LATENT_CHANNELS = 4
NUM_CLASSES = 1000  # DiTPipeline uses class id 1000 as the "null" class for guidance


def _seeded(seed: int, build):
    """Call ``build()`` with torch's global RNG seeded to ``seed`` (restored afterwards)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def _tiny_vae():
    """AutoencoderKL with two 16/32-channel levels: 2x downsampling, 4 latent channels.

    (32/64 channels would alone exceed the ~2 MB on-disk budget in float32.)
    """
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(16, 32),
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=8,
        sample_size=64,
    )


def _ddim_scheduler():
    """DDIM scheduler with the standard Stable Diffusion beta schedule."""
    from diffusers import DDIMScheduler

    return DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )


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


def _tiny_text_encoder(tokenizer):
    """CLIPTextModel (2 layers, 4 heads, hidden 32) whose ids match ``tokenizer``."""
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=NUM_HEADS,
        max_position_embeddings=tokenizer.model_max_length,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return CLIPTextModel(config)


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


def _build_sd(seed: int):
    """Assemble a tiny StableDiffusionPipeline; each component gets its own derived seed."""
    from diffusers import StableDiffusionPipeline

    from stage_runtime.models.tokenizer import build_clip_tokenizer

    tokenizer = build_clip_tokenizer()
    return StableDiffusionPipeline(
        vae=_seeded(seed, _tiny_vae),
        text_encoder=_seeded(seed + 1, lambda: _tiny_text_encoder(tokenizer)),
        tokenizer=tokenizer,
        unet=_seeded(seed + 2, _tiny_unet),
        scheduler=_ddim_scheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def _build_dit(seed: int):
    """Assemble a tiny DiTPipeline (``id2label`` is not persisted by diffusers, so none is set)."""
    from diffusers import DiTPipeline

    return DiTPipeline(
        transformer=_seeded(seed + 2, _tiny_dit_transformer),
        vae=_seeded(seed, _tiny_vae),
        scheduler=_ddim_scheduler(),
    )


def make_tiny_model(out_dir: str | Path, kind: Literal["sd", "dit"] = "sd", seed: int = 0) -> Path:
    """Write a tiny random-weight diffusers pipeline of ``kind`` to ``out_dir`` and return it.

    Same ``seed`` gives bitwise-identical weight files; the caller's torch RNG state is
    left untouched. Raises ``ValueError`` for an unknown ``kind``.
    """
    builders = {"sd": _build_sd, "dit": _build_dit}
    if kind not in builders:
        raise ValueError(f"unknown tiny model kind={kind!r}; expected one of {KINDS}")
    out = Path(out_dir)
    pipe = builders[kind](seed)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)
    return out
