"""A tiny WanPipeline in the Wan 2.1 T2V layout: the tiny UMT5 encoder (hidden 32, the tiny T5 tokenizer), a
2-layer WanTransformer3DModel (4 heads of 8, patch (1, 2, 2)), a causal 3D AutoencoderKLWan, flow matching
with a static shift of 7 (as diffusers' Wan tests; the real checkpoints ship UniPC, see ``wan22``).

Facts for the adapter (diffusers 0.42.1 ``pipeline_wan.py``):
- size: height and width multiples of 16 (VAE x8 times patch 2); ``check_inputs`` raises ``ValueError`` otherwise.
- frames: ``(num_frames - 1) % 4 == 0``; any other count is rounded down with a warning (10 -> 9).
- latents: 16 channels, VAE spatial x8, temporal x4 (latent frames ``(F - 1) // 4 + 1``); transformer tokens =
  latent frames x H/16 x W/16: 16x16x9 -> 3, 32x32x9 -> 12, 32x32x17 -> 20 (per CFG branch).
- text: ``max_sequence_length`` 512 (default); prompt embeds are zero-padded to it, so cross-attention always sees
  512 text tokens. Default call: 480x832, 81 frames, 50 steps, guidance 5.0, ``output_type="np"``; fps 16.
- the VAE's mid-block attention is single-head (Wan's VAE has no head count); every transformer and text
  encoder attention layer has 2 or 4 heads.
- about 375 KB on disk; rope_max_seq_len 1024 (as the real checkpoints: the default 480x832 fits).

"""

from __future__ import annotations

from stage_runtime.models.tiny.common import flow_match_euler, seeded
from stage_runtime.models.tiny.t5_tokenizer import T5_HIDDEN, build_t5_tokenizer, tiny_umt5_encoder

HEADS, HEAD_DIM = 4, 8
Z_DIM = 16
SHIFT = 7.0


def latent_statistics(channels: int) -> tuple[list[float], list[float]]:
    """Per-channel latents mean and std that are not the identity (the pipeline normalises with them)."""
    return [0.05 * (c % 5 - 2) for c in range(channels)], [0.8 + 0.1 * (c % 4) for c in range(channels)]


def tiny_wan_vae(**config):
    """AutoencoderKLWan: 4 channels at every level, spatial x8, temporal x4; ``config`` overrides (Wan 2.2)."""
    from diffusers import AutoencoderKLWan

    z_dim = config.get("z_dim", Z_DIM)
    mean, std = latent_statistics(z_dim)
    layout = {"base_dim": 4, "z_dim": z_dim, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1,
              "temperal_downsample": [False, True, True], "latents_mean": mean, "latents_std": std}
    return AutoencoderKLWan(**{**layout, **config})


def tiny_wan_transformer(**config):
    """WanTransformer3DModel: 2 layers, 4 heads of 8 (RoPE t/h/w dims 4/2/2), text width = the tiny T5's."""
    from diffusers import WanTransformer3DModel

    layout = {"patch_size": (1, 2, 2), "num_attention_heads": HEADS, "attention_head_dim": HEAD_DIM,
              "in_channels": Z_DIM, "out_channels": Z_DIM, "text_dim": T5_HIDDEN, "freq_dim": 32, "ffn_dim": 32,
              "num_layers": 2, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 1024}
    return WanTransformer3DModel(**{**layout, **config})


def components(seed: int, *, vae: dict | None = None, transformer: dict | None = None, scheduler=None) -> dict:
    """The parts every Wan pipeline takes (tokenizer, T5, VAE, transformer, scheduler), each with its own seed."""
    tokenizer = build_t5_tokenizer()
    return {
        "tokenizer": tokenizer,
        "text_encoder": seeded(seed + 1, lambda: tiny_umt5_encoder(tokenizer)),
        "vae": seeded(seed, lambda: tiny_wan_vae(**(vae or {}))),
        "transformer": seeded(seed + 2, lambda: tiny_wan_transformer(**(transformer or {}))),
        "scheduler": scheduler or flow_match_euler(SHIFT),
    }


def build(seed: int):
    from diffusers import WanPipeline

    return WanPipeline(**components(seed), transformer_2=None)
