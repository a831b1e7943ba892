"""`spec.engine`: how each pod's engine schedules, caches and bounds requests (the `stage-runtime serve` flags
of the same names, docs/stage-process.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from stage_operator.api.base import ApiModel, cel
from stage_runtime.config import MAX_CACHE_THRESHOLD

_CAMEL = ApiModel.model_config


class Cache(ApiModel):
    """The block cache (docs/cache.md): on a transformer family each step runs the first block and, while its
    residual changes less than `threshold`, reuses the other blocks' cached residual. A request may still send
    `cache: "off"` or its own threshold. A family or topology that cannot run it makes the stage exit 2."""

    mode: Literal["none", "block"] = Field("none", description=(
        "none (default): every step computes every block; block: the first-block residual cache for every "
        "request."))
    threshold: float = Field(0.1, ge=0.0, le=MAX_CACHE_THRESHOLD, description=(
        "Relative L1 change of the first block's residual under which a step reuses the cache (0-10, default "
        "0.1): higher skips more steps and drifts further from the uncached image."))
    warmup_steps: int = Field(1, ge=1, le=1000, description=(
        "The first steps always computed in full (default 1)."))
    final_steps: int = Field(1, ge=0, le=1000, description=(
        "The last steps always computed in full (default 1)."))


class Limits(ApiModel):
    """What one request may cost, and how long a running step may make no progress before the replica is
    fenced (unready: out of the Service) and then failed closed (exit 3 StepStalled; restarted)."""

    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": [cel(
        "self.stallFailSeconds > self.stallUnreadySeconds",
        "'engine.limits.stallFailSeconds (' + string(self.stallFailSeconds) + ') must be longer than "
        "stallUnreadySeconds (' + string(self.stallUnreadySeconds) + ')'")]})
    max_request_cost: int | None = Field(None, ge=1, description=(
        "The most one request may cost, in pixel-steps: width x height x steps x outputs (x frames for video); "
        "more is a 400 naming the field to shrink. Default: 1000 steps of one output at the model's native size."))
    stall_unready_seconds: int = Field(120, ge=1, le=86400, description=(
        "A running request makes no step progress this long: the pod reports unready (/ready 503 stalled) and "
        "leaves the Service until the step moves again (default 120)."))
    stall_fail_seconds: int = Field(600, ge=2, le=86400, description=(
        "... this long: the stage fails closed (exit 3, StepStalled in lastFailure) and the operator restarts "
        "it (default 600; longer than stallUnreadySeconds)."))
    decode_tile_side: int | None = Field(None, ge=32, le=4096, description=(
        "The VAE decode's memory bound: frames are decoded in overlapping tiles of at most this many pixels a "
        "side (video VAEs). Default: whole frames, as diffusers decodes them."))

    @model_validator(mode="after")
    def _fail_after_unready(self) -> Limits:
        if self.stall_fail_seconds <= self.stall_unready_seconds:
            raise ValueError(f"engine.limits.stallFailSeconds ({self.stall_fail_seconds}) must be longer than "
                             f"stallUnreadySeconds ({self.stall_unready_seconds})")
        return self


class Engine(ApiModel):
    """How each pod's engine schedules and runs requests: the `stage-runtime serve` flags of the same names
    (docs/stage-process.md). A value the model cannot run makes the stage exit 2 at startup (Stalled)."""

    execution_mode: Literal["request", "step"] = Field("request", description=(
        "request (default): each call runs whole pipelines for a wave of compatible requests; step: one "
        "denoising step at a time, so requests join and leave between steps (continuous batching, previews, "
        "preemption). step needs a model with the step contract."))
    max_num_seqs: int = Field(1, ge=1, le=1024, description=(
        "Requests running at once per pod (1-1024, default 1): in request mode a wave fused into one call, in "
        "step mode the running set. Also the default autoscaling.targetInFlightPerReplica."))
    request_batch_max_wait_ms: int = Field(0, ge=0, description=(
        "Request mode: milliseconds a wave may wait for compatible requests to join before it starts "
        "(default 0: at once); adds up to this much latency."))
    max_waiting: int | None = Field(None, ge=1, description=(
        "Bound of each pod's waiting queue (default: the runtime's 256); beyond it a new request is answered 429 "
        "queue_full with Retry-After."))
    streaming: bool = Field(False, description=(
        "true: every request gets per-step progress, not only those that ask to stream. Needs executionMode "
        "step: with request the stage refuses its config and exits 2 (Stalled). Default false."))
    executor: Literal["uni", "mp"] | None = Field(None, description=(
        "uni: the one rank runs in the stage process; mp: one worker process per rank. Default: uni for a "
        "world of one rank, else mp; uni with more ranks makes the stage exit 2."))
    device: Literal["auto", "cpu", "cuda"] | None = Field(None, description=(
        "auto (CUDA when visible, else CPU), cpu or cuda. Default: cpu when resources.gpuResourceName is \"\", "
        "else auto."))
    scheduling_policy: Literal["fcfs", "priority", "srpt"] = Field("fcfs", description=(
        "Which waiting request runs first: fcfs (default, arrival order), priority (a request's `priority`, "
        "higher first, aged so low ones still run) or srpt (fewest remaining steps first). In step mode priority "
        "and srpt also preempt a running request at a step boundary for a more urgent one."))
    cache: Cache = Field(default_factory=Cache)
    limits: Limits = Field(default_factory=Limits)
    extra_args: list[str] = Field(default_factory=list, description=(
        "More `stage-runtime serve` flags, appended after the operator's as given (e.g. --prompt-cache-bytes); "
        "an unknown flag makes the stage exit 2 (Stalled). Changing them rolls the pods."))
