"""Apply the configured parallelism to a loaded model (called by the worker once, after loading).

    world 1                    nothing (no torch.distributed at all)
    cfg_parallel_size = 2      enable_cfg_parallel(denoiser, cfg_group)
    ulysses_degree = P > 1     enable_ulysses(denoiser, sp_group, P)   (heads checked here: exit 2)
    tp / ring / pp > 1         ConfigError: not supported by this runtime yet

Both may be combined: CFG parallel splits the rows of a denoiser call, Ulysses the tokens inside it.
"""

from __future__ import annotations

from stage_runtime.config import ParallelConfig
from stage_runtime.distributed.cfg_parallel import enable_cfg_parallel
from stage_runtime.distributed.groups import ParallelGroups
from stage_runtime.distributed.ulysses import check_ulysses_heads, enable_ulysses
from stage_runtime.errors import ConfigError

_UNSUPPORTED = ("tensor_parallel_size", "ring_degree", "pipeline_parallel_size")


def check_supported(parallel: ParallelConfig, pipeline_class: str) -> None:
    """ConfigError for the dimensions the runtime cannot execute (without touching the model)."""
    for name in _UNSUPPORTED:
        value = getattr(parallel, name)
        if value > 1:
            raise ConfigError(f"{name}={value} is not supported by this runtime yet ({pipeline_class})")


def apply_parallelism(adapter, groups: ParallelGroups, parallel: ParallelConfig) -> None:
    """Install CFG-parallel and/or Ulysses on ``adapter.denoiser`` as ``parallel`` asks (world 1: no-op)."""
    if parallel.world_size == 1:
        return
    check_supported(parallel, type(adapter.pipe).__name__)
    if parallel.ulysses_degree > 1:
        check_ulysses_heads(adapter.num_attention_heads(), parallel.ulysses_degree)
    if parallel.cfg_parallel_size > 1:
        enable_cfg_parallel(adapter.denoiser, groups.cfg_group)
    if parallel.ulysses_degree > 1:
        enable_ulysses(adapter.denoiser, groups.sp_group, parallel.ulysses_degree)
