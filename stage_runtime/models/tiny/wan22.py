"""A tiny WanPipeline in the Wan 2.2 A14B (mixture of two experts) layout: the tiny Wan 2.1 parts plus a second
transformer (its own seed). ``boundary_ratio`` 0.875 (as the real A14B T2V): steps with ``t >= 875`` run
``transformer`` (high noise) with ``guidance_scale``, later ones ``transformer_2`` (low noise) with
``guidance_scale_2`` (it defaults to ``guidance_scale``). UniPC on flow sigmas (the solver the real Wan
checkpoints ship), flow shift 3 (as diffusers' Wan 2.2 tests; diffusers' Wan docs give 3 for 480P, 5 for 720P).

Facts for the adapter: everything in ``wan.py`` (16-multiples, ``(F - 1) % 4 == 0`` rounded down otherwise,
16 latent channels, VAE x8 / x4, ``max_sequence_length`` 512, fps 16); with 2 steps at shift 3 the first step is
above the boundary and the second below it, so a 2-step run uses both experts. UniPC is multistep: it keeps
the previous model outputs between steps (``scheduler.model_outputs``). About 530 KB on disk.
"""

from __future__ import annotations

from stage_runtime.models.tiny.common import seeded, unipc_flow
from stage_runtime.models.tiny.wan import components, tiny_wan_transformer

BOUNDARY_RATIO = 0.875
FLOW_SHIFT = 3.0


def build(seed: int):
    from diffusers import WanPipeline

    return WanPipeline(**components(seed, scheduler=unipc_flow(FLOW_SHIFT)),
                       transformer_2=seeded(seed + 3, tiny_wan_transformer), boundary_ratio=BOUNDARY_RATIO)
