"""Weight offload: explicit residency of pipeline components (and denoiser blocks), used only when ready.

    plan.py       which weights form which unit (component, denoiser head, denoiser block)
    tiers.py      where released bytes live: cpu <-> disk (safetensors, mmap) or cuda <-> cpu (host masters)
    manager.py    ResidencyManager: one state per unit, the only owner of transitions, bounded memory
    gather.py     where DLO's bytes live: 1/dp of each unit per data-parallel rank, all-gathered on load
    offloader.py  the policy (model-level phases, layerwise ring with prefetch) wired in by forward hooks

The model runner builds one with :func:`build_offloader` after loading and owns it; the worker's
``offload_stats()`` reports its accounting. DLO on an accelerator loads the pipeline on the host
(:func:`load_device`), puts what it does not shard on the device (:func:`place_unsharded`), and the GatherTier
builds each rank's shards on the device from the host bytes: a rank's device never holds the whole denoiser, at load
either.
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
    default = sharded_components(config, adapter) if config.mode == "distributed" else None   # DLO: the denoiser
    return Offloader(config, adapter.pipe, tuple(holders.values()), device, block_lists=adapter.block_lists,
                     components=default, groups=groups)


def load_device(config: OffloadConfig, device: torch.device) -> torch.device:
    """Where the runner loads the pipeline: the host for DLO on an accelerator (the shards are cut from the host
    copy, which is dropped after), else ``device``."""
    return torch.device("cpu") if config.dlo and device.type != "cpu" else device


def sharded_components(config: OffloadConfig, adapter) -> tuple[str, ...]:
    """The components DLO shards: the listed ones, else the denoiser (both experts of a routed one)."""
    return tuple(config.components) or tuple(adapter.block_holders())


def place_unsharded(config: OffloadConfig, adapter, device: torch.device) -> None:
    """After a host load (:func:`load_device`): every module component DLO does not shard goes to ``device``, and
    the adapter runs there; the sharded ones stay on the host until the GatherTier moves them."""
    sharded = set(sharded_components(config, adapter))
    for name, module in adapter.pipe.components.items():
        if isinstance(module, torch.nn.Module) and name not in sharded:
            module.to(device)
    adapter.device = device
