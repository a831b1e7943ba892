"""A tiny WanImageToVideoPipeline in the Wan 2.2 I2V A14B layout: two experts and no CLIP image encoder. The tiny
Wan parts with two transformers of 36 input channels (16 noisy latents + 4 first-frame mask + 16 image latents) and
no image tokens (``image_dim`` None), each expert its own seed; ``boundary_ratio`` 0.9 (as the real I2V A14B): steps
with ``t >= 900`` run ``transformer`` (high noise) with ``guidance_scale``, later ones ``transformer_2`` (low noise)
with ``guidance_scale_2``. UniPC on flow sigmas, flow shift 3 (``tiny/wan22.py``).

Facts for the adapter (diffusers 0.42.1 ``pipeline_wan_i2v.py``): ``image`` is required and only VAE-encoded (no
``image_embeds``: the pipeline refuses them with a boundary ratio); everything else as ``tiny/wan_i2v.py``. With 2
steps at shift 3 the first step is above the boundary and the second below it, so a 2-step run uses both experts.
About 550 KB on disk.
"""

from __future__ import annotations

from stage_runtime.models.tiny.common import seeded, unipc_flow
from stage_runtime.models.tiny.wan import Z_DIM, components, tiny_wan_transformer

BOUNDARY_RATIO = 0.9
FLOW_SHIFT = 3.0
I2V_CHANNELS = {"in_channels": 2 * Z_DIM + 4}


def build(seed: int):
    from diffusers import WanImageToVideoPipeline

    parts = components(seed, transformer=I2V_CHANNELS, scheduler=unipc_flow(FLOW_SHIFT))
    return WanImageToVideoPipeline(**parts, image_processor=None, image_encoder=None,
                                   transformer_2=seeded(seed + 3, lambda: tiny_wan_transformer(**I2V_CHANNELS)),
                                   boundary_ratio=BOUNDARY_RATIO)
