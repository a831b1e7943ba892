"""Stage configuration and parallel topology — the single source of truth for both halves.

Imported by the stage process *and* the Kubernetes operator, so it must never import torch or
diffusers and never reads the environment. Edge functions (:func:`load_config`,
:func:`load_config_file`) turn every validation failure into one :class:`ConfigError` whose
one-line message names each bad field and its value (a stage exits 2 on it).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from stage_runtime.config.compile import (MAX_SHAPES, SHAPE_PATTERN, CompileConfig, CompileMode,  # noqa: F401
                                          parse_shape)
from stage_runtime.config.jobs import JobsConfig  # noqa: F401 (re-exported)
from stage_runtime.config.limits import LimitsConfig  # noqa: F401 (re-exported)
from stage_runtime.config.offload import OffloadConfig, OffloadMode, dlo_refusal  # noqa: F401 (re-exported)
from stage_runtime.config.quantization import QuantizationConfig, QuantizationMethod  # noqa: F401 (re-exported)
from stage_runtime.config.sleep import ProfilerConfig, SleepConfig, SleepLevel  # noqa: F401 (re-exported)
from stage_runtime.config.parallel import ParallelConfig, ParallelDim, RankCoords  # noqa: F401 (re-exported)
from stage_runtime.errors import ConfigError
from stage_runtime.lora_spec import LORA_NAME_PATTERN, LoraSpec, StartupLoras  # noqa: F401 (re-exported)

__all__ = [
    "ConfigError", "ExecutionMode", "ParallelDim", "ModelConfig", "OffloadConfig", "OffloadMode", "ParallelConfig",
    "SchedulerConfig", "ServerConfig", "StageConfig", "RankCoords", "load_config", "load_config_file", "read_config_file",
    "merge_overrides", "CacheConfig", "CompileConfig", "QuantizationConfig", "SleepConfig", "ProfilerConfig", "JobsConfig", "LimitsConfig", "MAX_CACHE_THRESHOLD", "LoraSpec", "LORA_NAME_PATTERN",
]

ExecutionMode = Literal["request", "step"]
SchedulingPolicyName = Literal["fcfs", "priority", "srpt"]
CacheMode = Literal["none", "block"]
WorkerStartMethod = Literal["forkserver", "spawn"]
MAX_CACHE_THRESHOLD = 10.0          # a relative L1 change; 10 (1000 %) already means "skip whenever allowed"
_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
_FROZEN = ConfigDict(extra="forbid", frozen=True)


def _check_import_path(field: str, value: str, also: str = "") -> str:
    if not _IMPORT_PATH.match(value):
        raise ValueError(f"{field} must be {also}'package.module:ClassName', got {value!r}")
    return value


class ModelConfig(BaseModel):
    """Which local diffusers folder to serve (existence is checked at load time, not here)."""

    model_config = _FROZEN
    path: str = Field(min_length=1)
    served_name: str | None = None
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    adapter: str | None = None  # "package.module:ClassName", overrides the pipeline registry

    @field_validator("adapter")
    @classmethod
    def _adapter_path(cls, v: str | None) -> str | None:
        return None if v is None else _check_import_path("adapter", v)


class SchedulerConfig(BaseModel):
    """Scheduling policy. ``streaming_output=True`` resolves ``execution_mode`` to ``"step"``."""

    model_config = _FROZEN
    execution_mode: ExecutionMode = "request"
    max_num_seqs: int = Field(1, ge=1, le=1024)
    request_batch_max_wait_ms: float = Field(0.0, ge=0, allow_inf_nan=False)
    max_waiting: int = Field(256, ge=1)  # bounded waiting queue
    streaming_output: bool = False
    # Which waiting request goes first (stage_runtime.sched.policy); priority and srpt also preempt in step mode.
    scheduling_policy: SchedulingPolicyName = "fcfs"
    max_preemptions: int = Field(3, ge=0, le=1000)         # per request; then it runs to its end
    aging_ticks: int = Field(64, ge=0, le=1_000_000)       # one rank level per N ticks since admission (0: off)
    default_timeout_s: float | None = Field(None, gt=0, le=86400, allow_inf_nan=False)   # requests without one
    # Step state of preempted requests moved to host memory, at most this many bytes in all (0: kept in place).
    preempted_offload_max_bytes: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _streaming_implies_step(self) -> SchedulerConfig:
        if self.streaming_output and self.execution_mode != "step":
            if "execution_mode" in self.model_fields_set:
                raise ValueError("streaming_output=True requires execution_mode='step', "
                                 "but execution_mode='request' was set explicitly")
            object.__setattr__(self, "execution_mode", "step")  # frozen: resolve in place once
        return self


class ServerConfig(BaseModel):
    """How the stage process (``stage-runtime serve``) listens, drains and reports its end."""

    model_config = _FROZEN
    host: str = Field("0.0.0.0", min_length=1)
    http_port: int = Field(8000, ge=0, le=65535)     # 0: any free port (printed on startup)
    zmq_port: int = Field(5570, ge=0, le=65535)
    # SIGTERM grace for in-flight requests; below Kubernetes' default 30 s terminationGracePeriodSeconds.
    drain_timeout: float = Field(25.0, ge=0, le=3600, allow_inf_nan=False)
    termination_log: str | None = None               # None: /dev/termination-log when it exists
    api_key_file: str | None = Field(None, min_length=1)   # keys, one a line: /v1/* needs a Bearer key
    max_upload_bytes: int = Field(16 * 1024 * 1024, ge=1024)   # a multipart edit body; more → 413
    max_image_pixels: int = Field(4096 * 4096, ge=64)           # an uploaded or requested image; more → 413/400
    # Ready within this many seconds of the process start, or exit 1 with StartupTimeout (None: no limit).
    startup_timeout: float | None = Field(None, gt=0, le=86400, allow_inf_nan=False)
    playground: bool = True                          # the page at / (stage_runtime.playground); False: no page

    @model_validator(mode="after")
    def _distinct_ports(self) -> ServerConfig:
        if self.http_port and self.http_port == self.zmq_port:
            raise ValueError(f"http_port={self.http_port} and zmq_port={self.zmq_port} must differ")
        return self


class CacheConfig(BaseModel):
    """Cache acceleration (``stage_runtime.models.block_cache``, ``engine.result_cache``, ``models.prompt_cache``).

    ``mode: block`` is the default policy of every request on a transformer family (a request may send
    ``cache: "off"`` or its own ``{threshold}``): each step runs the first block, and when the relative L1
    change of its residual against the request's last computed step is under ``threshold`` the other blocks
    are skipped and their cached residual is reused. The first ``warmup_steps`` and the last ``final_steps``
    steps are always computed; ``max_consecutive_skips`` (0: no limit) forces a computed step after that many
    skips. ``result_max_bytes`` > 0 turns on the exact-hit result cache (requests with an explicit seed);
    ``prompt_max_bytes`` > 0 the prompt-embedding cache. Both are LRUs bounded by those bytes.
    """

    model_config = _FROZEN
    mode: CacheMode = "none"
    threshold: float = Field(0.1, ge=0.0, le=MAX_CACHE_THRESHOLD, allow_inf_nan=False)
    warmup_steps: int = Field(1, ge=1, le=1000)
    final_steps: int = Field(1, ge=0, le=1000)
    max_consecutive_skips: int = Field(0, ge=0, le=1000)
    result_max_bytes: int = Field(0, ge=0)
    prompt_max_bytes: int = Field(0, ge=0)
class StageConfig(BaseModel):
    """Everything one stage process needs; the top level of ``stage.yaml``."""

    model_config = _FROZEN
    model: ModelConfig
    device: Literal["auto", "cpu", "cuda"] = "auto"
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    offload: OffloadConfig = Field(default_factory=OffloadConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    compile: CompileConfig = Field(default_factory=CompileConfig)
    quantization: QuantizationConfig = Field(default_factory=QuantizationConfig)
    sleep: SleepConfig = Field(default_factory=SleepConfig)
    profiler: ProfilerConfig = Field(default_factory=ProfilerConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    jobs: JobsConfig = Field(default_factory=JobsConfig)     # the /v1/videos job API (off without a store)
    executor: str | None = None  # "uni" | "mp" | "package.module:ClassName"; None → resolved_executor
    warmup: bool = True
    worker_startup_timeout_s: float = Field(600.0, gt=0, allow_inf_nan=False)  # mp: every rank loaded and ready
    worker_start_method: WorkerStartMethod = "forkserver"   # mp: ranks fork from one preloaded server, or spawn
    collective_timeout_s: float = Field(600.0, gt=0, allow_inf_nan=False)      # a stuck collective is fatal
    server: ServerConfig = Field(default_factory=ServerConfig)
    max_loras: int = Field(8, ge=1, le=1024)        # resident LoRA adapters at most (LRU among the unpinned)
    loras: StartupLoras = ()                        # loaded (and checked) at startup; pinned unless said

    @field_validator("executor")
    @classmethod
    def _executor_name(cls, v: str | None) -> str | None:
        return v if v in (None, "uni", "mp") else _check_import_path("executor", v, "'uni', 'mp' or ")

    @model_validator(mode="after")
    def _executor_fits_world(self) -> StageConfig:
        world = self.parallel.world_size
        if self.executor == "uni" and world > 1:
            raise ValueError(f"executor='uni' runs exactly one rank but world_size={world}; "
                             "use executor='mp' (or leave executor unset)")
        refusal = dlo_refusal(self)
        if refusal:
            raise ValueError(refusal)
        if self.compile.enabled and self.offload.per_rank_mode == "layerwise":
            raise ValueError(f"compile.mode={self.compile.mode!r} with offload.mode='layerwise': layerwise offload "
                             "swaps the weights of each denoiser block from hooks inside the blocks a compiled graph "
                             "runs; use offload.mode='model' over the other components, or compile.mode='none'")
        quant = self.quantization.method
        if quant != "none" and self.offload.per_rank_mode == "layerwise":
            raise ValueError(f"quantization.method={quant!r} with offload.mode='layerwise': the offloader swaps the "
                             "denoiser's plain weight storages block by block, and a quantized weight is not one; "
                             "use offload.mode='model' over the components left unquantized")
        if quant != "none" and self.offload.mode == "model":
            both = sorted(set(self.quantization.components) & set(self.offload.components))
            if not self.offload.components or both:
                what = f"lists {', '.join(both)}" if both else "is empty (every component, the quantized ones too)"
                raise ValueError(f"quantization.method={quant!r} with offload.mode='model': offload.components {what}; "
                                 "the offloader moves plain weight storages, so offload only the components left "
                                 "unquantized (e.g. text_encoder, vae)")
        if self.sleep.enabled and self.offload.mode != "none":
            raise ValueError(f"sleep.enabled with offload.mode={self.offload.mode!r}: the offloader decides where "
                             "the weights live, and a sleep moves or drops them; use one or the other")
        if quant != "none" and self.parallel.tensor_parallel_size > 1:
            raise ValueError(f"quantization.method={quant!r} with tensor_parallel_size="
                             f"{self.parallel.tensor_parallel_size}: tensor parallel cuts full-precision weights; "
                             "quantized weights are not sharded (use Ulysses, ring or CFG parallel)")
        return self

    @property
    def resolved_executor(self) -> str:
        """``executor`` if given, else ``"uni"`` for a world of one rank and ``"mp"`` otherwise."""
        if self.executor is not None:
            return self.executor
        return "uni" if self.parallel.world_size == 1 else "mp"


def _format_errors(exc: ValidationError) -> str:
    """One line: each problem as ``dotted.path=<input!r>: msg``, joined by '; '."""
    problems = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            problems.append(f"unknown field {loc} (Extra inputs are not permitted)")
        elif err["type"] == "missing":
            problems.append(f"{loc}: Field required")
        elif isinstance(err.get("input"), dict):  # model-level rule: the message names fields itself
            problems.append(f"{loc}: {msg}" if loc else msg)
        else:
            problems.append(f"{loc}={err.get('input')!r}: {msg}")
    return "; ".join(problems)


def load_config(data: dict) -> StageConfig:
    """Validate a StageConfig dict; raise :class:`ConfigError` naming every bad field."""
    if not isinstance(data, dict):
        raise ConfigError(f"stage config must be a mapping, got {type(data).__name__}")
    try:
        return StageConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"invalid stage config: {_format_errors(exc)}") from None


def read_config_file(path: str | Path) -> dict:
    """The YAML mapping of a config file, unvalidated (it may be partial: flags complete it)."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {' '.join(str(exc).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r}: top level must be a mapping, got {type(data).__name__}")
    return data


def load_config_file(path: str | Path, overrides: dict | None = None, defaults: dict | None = None) -> StageConfig:
    """Load a YAML file whose top level is (part of) the StageConfig dict, over ``defaults`` and under
    ``overrides`` (the CLI's flags), validated once after merging: a file may hold only ``offload:`` if the
    flags give the model."""
    data = merge_overrides(merge_overrides(defaults or {}, read_config_file(path)), overrides or {})
    try:
        return load_config(data)
    except ConfigError as exc:
        source = f"config file {str(path)!r}" + (" with the command-line flags" if overrides else "")
        raise ConfigError(f"{source}: {exc}") from None


def merge_overrides(base: dict, overrides: dict) -> dict:
    """Deep-merge ``overrides`` onto a copy of ``base``; None override values are ignored.

    Used by the CLI: ``--config stage.yaml`` is the base and explicit flags win.
    """
    merged = copy.deepcopy(base)
    for key, value in overrides.items():
        if value is None:
            continue
        if isinstance(value, dict):
            current = merged.get(key)
            merged[key] = merge_overrides(current if isinstance(current, dict) else {}, value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged

