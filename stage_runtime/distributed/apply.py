"""Apply the configured parallelism to a loaded model (called by the worker once, after loading).

    world 1                    nothing (no torch.distributed at all)
    cfg_parallel_size = 2      adapter.enable_cfg_parallel(cfg_group)     (the family must list "cfg")
    ulysses_degree = P > 1     adapter.enable_ulysses(sp_group, P)        (lists "ulysses"; heads checked)
    tp / ring / pp > 1         ConfigError: not supported by this runtime yet

What a family supports is its adapter's ``parallel_kinds``; how it is installed is the adapter's hook
(the defaults wrap the denoiser with distributed.cfg_parallel / distributed.ulysses). Anything asked for
that the family does not list is a ConfigError naming the family and the degree (the stage exits 2).

Both may be combined: CFG parallel splits the rows of a denoiser call, Ulysses the tokens inside it.
"""

from __future__ import annotations

from stage_runtime.config import ParallelConfig
from stage_runtime.distributed.groups import ParallelGroups
from stage_runtime.distributed.ulysses import check_ulysses_heads
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
    family = type(adapter.pipe).__name__
    check_supported(parallel, family)
    for kind, name in (("cfg", "cfg_parallel_size"), ("ulysses", "ulysses_degree")):
        degree = getattr(parallel, name)
        if degree > 1 and kind not in adapter.parallel_kinds:
            runs = ", ".join(sorted(adapter.parallel_kinds)) or "no in-model parallelism"
            why = adapter.parallel_refusal(kind)
            raise ConfigError(f"{name}={degree} is not supported by {family} (it runs: {runs})"
                              + (f": {why}" if why else ""))
    if parallel.ulysses_degree > 1:
        check_ulysses_heads(adapter.num_attention_heads(), parallel.ulysses_degree)
    if parallel.cfg_parallel_size > 1:
        adapter.enable_cfg_parallel(groups.cfg_group)
    if parallel.ulysses_degree > 1:
        adapter.enable_ulysses(groups.sp_group, parallel.ulysses_degree)
