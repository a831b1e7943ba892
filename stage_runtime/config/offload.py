"""Weight offload (part of :mod:`stage_runtime.config`; the runtime is :mod:`stage_runtime.offload`; docs/offload.md).

``mode``:

- ``model``: a component is brought in before its phase (encode, denoise, decode) and released after it;
- ``layerwise``: the denoiser's blocks are brought in one ahead of use and released behind (other listed components
  are handled model-level);
- ``distributed`` (distributed layerwise offload, DLO; ``--enable-distributed-layerwise-offload``): with
  ``allgather`` (the default) every data-parallel rank keeps 1/dp of the denoiser's bytes (its head and each of its
  blocks) and the ranks all-gather a block just before it runs and drop the gathered copy after: the model is held
  once across the ranks, and each rank computes its own requests in lock-step waves. ``allgather: false`` is the
  rank-local variant: each rank streams its own blocks from its own disk copy (``layerwise`` per rank, no waves).

``components`` empty = every module component of the pipeline (``distributed``: the denoiser alone; names are
checked against the pipeline when it is loaded). ``max_host_bytes`` bounds the host memory the offloader holds for
managed weights; ``dir`` is where the offload files go.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stage_runtime.config.component_names import check_component_names

OffloadMode = Literal["none", "model", "layerwise", "distributed"]
_FROZEN = ConfigDict(extra="forbid", frozen=True)


class OffloadConfig(BaseModel):
    """Weight offload: which components, how, and the memory bound (see the module's docstring)."""

    model_config = _FROZEN
    mode: OffloadMode = "none"
    components: tuple[str, ...] = ()
    resident_layers: int = Field(2, ge=1)      # layerwise: blocks materialised at once (incl. the one prefetched)
    max_host_bytes: int | None = Field(None, ge=1)
    prefetch: bool = True                       # layerwise: load the next block ahead (distributed: its gather)
    dir: str | None = Field(None, min_length=1)  # parent of the runner's temporary offload folder
    allgather: bool = True                      # distributed: shards + all-gather (False: each rank from its disk)

    @field_validator("components")
    @classmethod
    def _component_names(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return check_component_names(v)

    @model_validator(mode="after")
    def _fields_fit_mode(self) -> OffloadConfig:
        # Non-default values that the mode would ignore are mistakes (a dumped config round-trips: defaults pass).
        set_fields = {n for n, f in type(self).model_fields.items() if n != "mode" and getattr(self, n) != f.default}
        if "allgather" in set_fields and self.mode != "distributed":
            raise ValueError(f"allgather=False only applies to mode='distributed' (mode={self.mode!r})")
        if self.mode == "none" and set_fields:
            raise ValueError(f"{sorted(set_fields)[0]} is set but mode='none'; "
                             "set mode to 'model', 'layerwise' or 'distributed'")
        layer_only = set_fields & {"resident_layers", "prefetch"}
        if self.mode == "model" and layer_only:
            raise ValueError(f"{sorted(layer_only)[0]} only applies to mode='layerwise' or 'distributed' "
                             "(mode='model')")
        if self.mode in ("layerwise", "distributed") and self.prefetch and self.resident_layers < 2:
            raise ValueError(f"resident_layers={self.resident_layers} must be >= 2 with prefetch=True "
                             "(the running block and the one prefetched ahead); set prefetch=False or raise it")
        if self.dlo and self.max_host_bytes is not None:
            raise ValueError(f"max_host_bytes={self.max_host_bytes} does not apply to mode='distributed' with "
                             "allgather: a rank holds its shards and the gathered window, nothing on disk")
        return self

    @property
    def dlo(self) -> bool:
        """Distributed layerwise offload with all-gather: the lock-step wave path."""
        return self.mode == "distributed" and self.allgather

    @property
    def per_rank_mode(self) -> str:
        """What each rank runs by itself: the rank-local variant of ``distributed`` is ``layerwise``."""
        return "layerwise" if self.mode == "distributed" and not self.allgather else self.mode


def dlo_refusal(stage) -> str | None:
    """Why ``stage`` (a StageConfig) cannot run distributed layerwise offload with all-gather, or None.

    Every data-parallel rank enters the same gathers in the same order, so everything that could make one rank's
    sequence of denoiser calls differ from another's is refused: model parallelism inside the ranks (unproven
    composition), step mode (per-request state and per-tick joins), caches that skip blocks by a rank-local decision,
    and the wrappers that change what a block's weights are (compile, quantization, sleep).
    """
    offload, parallel = stage.offload, stage.parallel
    if not offload.dlo:
        return None
    if parallel.dp_size < 2:
        return (f"offload.mode='distributed' shards the denoiser across data-parallel ranks, but "
                f"{parallel.describe()} has dp=1; give num_gpus (or data_parallel_size) > 1")
    if parallel.model_parallel_size > 1:
        return (f"offload.mode='distributed' with {parallel.describe()}: every rank must be its own data-parallel "
                "replica (tensor, sequence, pipeline and CFG parallel size 1); use Ulysses or TP instead of DLO, "
                "or DLO alone")
    if stage.scheduler.execution_mode != "request":
        return ("offload.mode='distributed' with execution_mode='step': a step-mode tick joins, preempts and ends "
                "requests per rank, so the ranks would leave the lock-step gathers; use execution_mode='request'")
    if stage.cache.mode != "none":
        return (f"offload.mode='distributed' with cache.mode={stage.cache.mode!r}: a rank that skips blocks by its "
                "own cache decision would leave the others waiting in the gather; use cache.mode='none'")
    if stage.cache.prompt_max_bytes and offload.components and any(
            name.startswith("text_encoder") for name in offload.components):
        return ("offload.mode='distributed' over a text encoder with cache.prompt_max_bytes > 0: a prompt-cache hit "
                "skips the encoder's gather on one rank only; drop one of them")
    if stage.compile.enabled:
        return (f"compile.mode={stage.compile.mode!r} with offload.mode='distributed': the gathers swap each "
                "block's weights from hooks inside what a compiled graph runs; use compile.mode='none'")
    if stage.quantization.method != "none":
        return (f"quantization.method={stage.quantization.method!r} with offload.mode='distributed': the shards "
                "are plain weight storages, and a quantized weight is not one")
    return None
