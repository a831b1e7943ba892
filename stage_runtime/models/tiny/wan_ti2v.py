"""A tiny WanPipeline in the Wan 2.2 TI2V-5B layout: the Wan 2.2 VAE (48 latent channels, a residual
encoder and decoder, 2x2 pixel patchification, spatial x16), one transformer with 48 channels in and out,
``expand_timesteps=True`` (a timestep per latent token: Wan 2.2's per-frame timesteps), UniPC flow shift 3.

Facts for the adapter (diffusers 0.42.1 ``pipeline_wan.py``):
- size: ``check_inputs`` asks for multiples of 16 (``ValueError`` otherwise) but the patch grid is VAE x16 times
  patch 2 = 32: a multiple of 16 that is not one of 32 is rounded down with a warning (48 -> 32). Use 32.
- frames: ``(num_frames - 1) % 4 == 0``; others rounded down with a warning.
- latents: 48 channels, VAE spatial x16, temporal x4; tokens = latent frames x H/32 x W/32: 32x32x9 -> 3,
  64x64x9 -> 12.
- text: ``max_sequence_length`` 512, fps 24 (the real TI2V-5B makes 121 frames at 24 fps). About 500 KB on disk.
"""

from __future__ import annotations

from stage_runtime.models.tiny.common import unipc_flow
from stage_runtime.models.tiny.wan import components
from stage_runtime.models.tiny.wan22 import FLOW_SHIFT

Z_DIM = 48
VAE = {"z_dim": Z_DIM, "in_channels": 12, "out_channels": 12, "is_residual": True, "patch_size": 2,
       "scale_factor_spatial": 16, "scale_factor_temporal": 4}


def build(seed: int):
    from diffusers import WanPipeline

    parts = components(seed, vae=VAE, transformer={"in_channels": Z_DIM, "out_channels": Z_DIM},
                       scheduler=unipc_flow(FLOW_SHIFT))
    return WanPipeline(**parts, transformer_2=None, expand_timesteps=True)
