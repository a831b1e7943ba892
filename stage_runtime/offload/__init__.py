"""Weight offload: explicit residency of pipeline components (and denoiser blocks), used only when ready.

    plan.py       which weights form which unit (component, denoiser head, denoiser block)
    tiers.py      where released bytes live: cpu <-> disk (safetensors, mmap) or cuda <-> cpu (host masters)
    manager.py    ResidencyManager: one state per unit, the only owner of transitions, bounded memory
    gather.py     where DLO's bytes live: 1/dp of each unit per data-parallel rank, all-gathered on load
    offloader.py  the policy (model-level phases, layerwise ring with prefetch) wired in by forward hooks

The model runner builds one with :func:`build_offloader` after loading and owns it; the worker's
``offload_stats()`` reports its accounting.
"""

from __future__ import annotations

import torch

from stage_runtime.config import OffloadConfig


def build_offloader(config: OffloadConfig, adapter, device: torch.device, groups=None):
    """An :class:`~stage_runtime.offload.offloader.Offloader` for ``adapter``'s pipeline, or None (mode none).
    ``groups`` (the rank's ParallelGroups) carries the data-parallel group DLO gathers over."""
    if config.mode == "none":
        return None
    from stage_runtime.offload.offloader import Offloader

    holders = adapter.block_holders()                          # the denoiser; Wan 2.2: both experts
    default = tuple(holders) if config.mode == "distributed" else None      # DLO: the denoiser alone by default
    return Offloader(config, adapter.pipe, tuple(holders.values()), device, block_lists=adapter.block_lists,
                     components=default, groups=groups)
