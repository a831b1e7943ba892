"""Apply the configured parallelism to a loaded model (called by the worker once, after loading).

    world 1                       nothing (no torch.distributed at all)
    tensor_parallel_size = T > 1  adapter.enable_tensor_parallel(tp_group, T)   (lists "tp"; heads, hidden checked)
    cfg_parallel_size = 2         adapter.enable_cfg_parallel(cfg_group)        (lists "cfg")
    ring_degree = R > 1           adapter.enable_sequence_parallel(U, mesh)     (lists "ring"; Ulysses U × ring R)
    ulysses_degree = U > 1        adapter.enable_ulysses(ulysses_group, U)      (lists "ulysses"; heads checked)
    pipeline_parallel_size > 1    ConfigError: not run by this runtime (see PIPELINE_REFUSAL)

What a family supports is its adapter's ``parallel_kinds``; how it is installed is the adapter's hook
(the defaults wrap the denoiser with distributed.tensor_parallel / cfg_parallel / ulysses). Anything asked
for that the family does not list is a ConfigError naming the family and the degree (the stage exits 2).

They compose: TP shards the weights of each block (first, so the head checks below see local heads),
CFG parallel splits the rows of a denoiser call, Ulysses × ring the tokens inside it.
"""

from __future__ import annotations

from stage_runtime.config import ParallelConfig
from stage_runtime.distributed.groups import ParallelGroups
from stage_runtime.distributed.sequence_shard import check_ulysses_heads
from stage_runtime.distributed.usp import SequenceMesh
from stage_runtime.errors import ConfigError

PIPELINE_REFUSAL = ("this runtime does not run pipeline parallelism (PipeFusion-style patch pipelining is not "
                    "implemented); split the model with tensor_parallel_size, ulysses_degree/ring_degree or "
                    "cfg_parallel_size instead")
_KINDS = (("tp", "tensor_parallel_size"), ("cfg", "cfg_parallel_size"), ("ulysses", "ulysses_degree"),
          ("ring", "ring_degree"))


def check_supported(parallel: ParallelConfig, pipeline_class: str) -> None:
    """ConfigError for the dimensions the runtime cannot execute at all (without touching the model)."""
    if parallel.pipeline_parallel_size > 1:
        raise ConfigError(f"pipeline_parallel_size={parallel.pipeline_parallel_size} is not supported "
                          f"({pipeline_class}): {PIPELINE_REFUSAL}")


def check_heads(heads: int, parallel: ParallelConfig) -> None:
    """ConfigError unless TP × Ulysses divides the attention heads (both split heads across ranks)."""
    tp, ulysses = parallel.tensor_parallel_size, parallel.ulysses_degree
    if tp == 1:
        check_ulysses_heads(heads, ulysses)
    elif heads % (tp * ulysses):
        raise ConfigError(f"tensor_parallel_size={tp} × ulysses_degree={ulysses} = {tp * ulysses} does not divide "
                          f"the model's attention heads (num_attention_heads={heads}): both split heads across ranks")


def apply_parallelism(adapter, groups: ParallelGroups, parallel: ParallelConfig) -> None:
    """Install TP, CFG parallel and Ulysses × ring on ``adapter.denoiser`` as ``parallel`` asks (world 1: no-op)."""
    if parallel.world_size == 1:
        return
    family = type(adapter.pipe).__name__
    check_supported(parallel, family)
    for kind, name in _KINDS:
        degree = getattr(parallel, name)
        if degree > 1 and kind not in adapter.parallel_kinds:
            runs = ", ".join(sorted(adapter.parallel_kinds)) or "no in-model parallelism"
            why = adapter.parallel_refusal(kind)
            raise ConfigError(f"{name}={degree} is not supported by {family} (it runs: {runs})"
                              + (f": {why}" if why else ""))
    check_heads(adapter.num_attention_heads(), parallel)
    if parallel.tensor_parallel_size > 1:
        adapter.enable_tensor_parallel(groups.tp_group, parallel.tensor_parallel_size)
    if parallel.cfg_parallel_size > 1:
        adapter.enable_cfg_parallel(groups.cfg_group)
    if parallel.ring_degree > 1:
        adapter.enable_sequence_parallel(parallel.ulysses_degree, lambda: SequenceMesh.from_groups(groups, parallel))
    elif parallel.ulysses_degree > 1:
        adapter.enable_ulysses(groups.ulysses_group, parallel.ulysses_degree)
