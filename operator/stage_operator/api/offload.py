"""`spec.offload`: where the weights live between uses (the stage config's `offload:`,
`stage_runtime.config.OffloadConfig`; docs/offload.md).

The modes are the runtime's own (`OffloadMode`), so the CRD never admits one the stage would refuse. The fields map
onto the stage's `offload:` section (builders.runtime_config, only when `mode` is not none): mode → `mode`,
components → `components`, residentLayers → `resident_layers`, prefetch → `prefetch`, allgather → `allgather`.

`distributed` with `allgather` (DLO) is a topology of its own: every rank is a data-parallel replica that holds 1/dp
of the denoiser and computes its own request in lock-step waves. The spec-level rules (CEL on StageSpec, and the
same words from the operator's parse) refuse what the runtime would refuse at startup: dp 1, model parallelism in the
same ranks, step mode, the block cache, compile and quantization. What CEL does not cover (a field the mode ignores)
the operator's parse refuses with the runtime's own check.
"""

from __future__ import annotations

from typing import Annotated, Any, get_args

from pydantic import ConfigDict, Field, ValidationError, model_validator

from stage_operator.api.base import ApiModel, cel
from stage_runtime.config import ConfigError, OffloadConfig, OffloadMode, load_config

_CAMEL = ApiModel.model_config
MODES: tuple[str, ...] = get_args(OffloadMode)
MAX_COMPONENTS = 16
COMPONENT_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"   # ASCII: never wider than the runtime's identifier check

Component = Annotated[str, Field(pattern=COMPONENT_PATTERN, max_length=64, description=(
    "A pipeline attribute name (e.g. transformer, text_encoder, vae)."))]

_RULES = [
    cel("!has(self.allgather) || self.allgather || self.mode == 'distributed'",
        "'offload.allgather applies only to mode distributed, not ' + self.mode"),
    cel("self.mode in ['layerwise', 'distributed'] || ((!has(self.prefetch) || self.prefetch) && "
        "(!has(self.residentLayers) || self.residentLayers == 2))",
        "'offload.prefetch and offload.residentLayers apply only to modes layerwise and distributed, not ' + "
        "self.mode"),
]


class Offload(ApiModel):
    """Where the weights live between uses (docs/offload.md). Off (none) by default: every rank holds the whole
    pipeline on its device. Offload trades speed for device memory; `distributed` (DLO) holds the denoiser once across
    the data-parallel ranks of a pod, each rank computing its own request. Every field is a startup setting: changing
    one rolls the pods."""

    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": _RULES})
    mode: OffloadMode = Field("none", description=(
        "none (default): the weights on the device. model: each component brought in before its phase (encode, "
        "denoise, decode) and released after it. layerwise: the denoiser's blocks brought in one ahead of use and "
        "released behind. distributed: distributed layerwise offload (DLO): each of parallel.dataParallelSize ranks "
        "keeps 1/dp of every denoiser block and all-gathers a block just before it runs; the ranks serve different "
        "requests in lock-step waves. distributed needs dataParallelSize > 1, every other degree 1, "
        "engine.executionMode request, no block cache, compile or quantization (CEL)."))
    components: list[Component] | None = Field(None, max_length=MAX_COMPONENTS, description=(
        f"The pipeline components offloaded (at most {MAX_COMPONENTS}). Default: every module component "
        "(distributed: the denoiser)."))
    resident_layers: int = Field(2, ge=1, le=1024, description=(
        "layerwise and distributed: denoiser blocks materialised at once, the prefetched one included (default 2; "
        "at least 2 with prefetch)."))
    prefetch: bool = Field(True, description=(
        "layerwise: load the next block on a background thread; distributed: start the next block's all-gather "
        "while the current block runs (default true)."))
    allgather: bool = Field(True, description=(
        "distributed only: true (default) shards the denoiser over the ranks and all-gathers each block; false is the "
        "rank-local variant (each rank streams its own blocks from its own disk copy, layerwise per rank)."))

    @model_validator(mode="after")
    def _runtime_accepts(self) -> Offload:
        if not self.allgather and self.mode != "distributed":
            raise ValueError(f"offload.allgather applies only to mode distributed, not {self.mode}")
        if self.mode not in ("layerwise", "distributed") and (not self.prefetch or self.resident_layers != 2):
            raise ValueError("offload.prefetch and offload.residentLayers apply only to modes layerwise and "
                             f"distributed, not {self.mode}")
        try:
            self.runtime()   # the runtime's own checks, so the stage never refuses what the operator admitted
        except ValidationError as exc:
            words = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
            raise ValueError(f"offload: {words}") from None
        return self

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def dlo(self) -> bool:
        return self.mode == "distributed" and self.allgather

    def runtime(self) -> OffloadConfig:
        """The stage config's `offload:` section."""
        return OffloadConfig(mode=self.mode, components=tuple(self.components or ()),
                             resident_layers=self.resident_layers, prefetch=self.prefetch, allgather=self.allgather)


_DLO = ("has(self.offload) && self.offload.mode == 'distributed' && "
        "(!has(self.offload.allgather) || self.offload.allgather)")
_MODEL_PARALLEL = ("self.parallel.tensorParallelSize * self.parallel.ulyssesDegree * self.parallel.ringDegree * "
                   "self.parallel.cfgParallelSize * self.parallel.pipelineParallelSize")
_WHY_DP = "it shards the denoiser over the data-parallel ranks; set parallel.dataParallelSize > 1"
_WHY_MP = ("every rank must be a data-parallel replica (tensor, ulysses, ring, cfg and pipeline 1); use Ulysses or "
           "TP instead of DLO, or DLO alone")
_WHY_STEP = "a step-mode tick joins and ends requests per rank, out of the lock-step gathers; use request"
_WHY_CACHE = "a rank skipping blocks by its own cache decision would leave the others waiting in the gather"
_WHY_COMPILE = "the gathers swap the weights of each block inside what a compiled graph runs"
_WHY_QUANT = "the shards are plain weight storages, and a quantized weight is not one"
_HEAD = "'offload.mode distributed with "

SPEC_RULES = [
    cel(f"!({_DLO}) || self.parallel.dataParallelSize > 1",
        f"{_HEAD}parallel.dataParallelSize ' + string(self.parallel.dataParallelSize) + ': {_WHY_DP}'"),
    cel(f"!({_DLO}) || {_MODEL_PARALLEL} == 1",
        f"{_HEAD}model parallelism (tensor ' + string(self.parallel.tensorParallelSize) + ' x ulysses ' + "
        "string(self.parallel.ulyssesDegree) + ' x ring ' + string(self.parallel.ringDegree) + ' x cfg ' + "
        "string(self.parallel.cfgParallelSize) + ' x pipeline ' + string(self.parallel.pipelineParallelSize) + "
        f"'): {_WHY_MP}'"),
    cel(f"!({_DLO}) || self.engine.executionMode == 'request'",
        f"{_HEAD}engine.executionMode ' + self.engine.executionMode + ': {_WHY_STEP}'"),
    cel(f"!({_DLO}) || self.engine.cache.mode == 'none'",
        f"{_HEAD}engine.cache.mode ' + self.engine.cache.mode + ': {_WHY_CACHE}'"),
    cel(f"!({_DLO}) || !has(self.compile) || self.compile.mode == 'none'",
        f"{_HEAD}compile.mode ' + self.compile.mode + ': {_WHY_COMPILE}'"),
    cel(f"!({_DLO}) || !has(self.quantization) || self.quantization.method == 'none'",
        f"{_HEAD}quantization.method ' + self.quantization.method + ': {_WHY_QUANT}'"),
]


def spec_refusal(spec: Any) -> str | None:
    """Why a StageSpec cannot run its offload, or None: SPEC_RULES' words (the same checks, the same message), then
    the runtime's own cross-section rules (compile, quantization or sleep with an offload mode), so a stage the
    operator admitted never exits 2 on them."""
    offload = spec.offload
    if offload is None or not offload.enabled:
        return None
    parallel, engine, head = spec.parallel, spec.engine, "offload.mode distributed with "
    mp = (parallel.tensor_parallel_size, parallel.ulysses_degree, parallel.ring_degree, parallel.cfg_parallel_size,
          parallel.pipeline_parallel_size)
    compile, quantization = spec.compile, spec.quantization
    if offload.dlo and parallel.data_parallel_size < 2:
        return f"{head}parallel.dataParallelSize {parallel.data_parallel_size}: {_WHY_DP}"
    if offload.dlo and mp != (1, 1, 1, 1, 1):
        return (f"{head}model parallelism (tensor {mp[0]} x ulysses {mp[1]} x ring {mp[2]} x cfg {mp[3]} x "
                f"pipeline {mp[4]}): {_WHY_MP}")
    if offload.dlo and engine.execution_mode != "request":
        return f"{head}engine.executionMode {engine.execution_mode}: {_WHY_STEP}"
    if offload.dlo and engine.cache.mode != "none":
        return f"{head}engine.cache.mode {engine.cache.mode}: {_WHY_CACHE}"
    if offload.dlo and compile is not None and compile.enabled:
        return f"{head}compile.mode {compile.mode}: {_WHY_COMPILE}"
    if offload.dlo and quantization is not None and quantization.enabled:
        return f"{head}quantization.method {quantization.method}: {_WHY_QUANT}"
    section = {"model": {"path": "/model"}, "parallel": spec.topology(), "offload": offload.runtime(),
               "scheduler": {"execution_mode": engine.execution_mode}, "cache": {"mode": engine.cache.mode}}
    if compile is not None:
        section["compile"] = compile.runtime(None)
    if quantization is not None:
        section["quantization"] = quantization.runtime()
    if spec.sleep is not None:
        section["sleep"] = spec.sleep.runtime()
    try:
        load_config(section)
    except ConfigError as exc:
        return f"spec.offload: {exc}".replace("invalid stage config: ", "the runtime refuses it: ")
    return None
