"""`DiffusionStage.status` (docs/crd.md): fully typed, so the API server prunes nothing the operator writes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from stage_operator.api.base import ApiModel

Phase = Literal["Pending", "Progressing", "Ready", "Degraded", "Stalled"]
ConditionType = Literal["Accepted", "Ready", "Progressing", "Degraded", "Stalled"]
CONDITION_TYPES: tuple[str, ...] = ("Accepted", "Ready", "Progressing", "Degraded", "Stalled")


class Condition(ApiModel):
    type: ConditionType
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(min_length=1)
    message: str = ""
    observed_generation: int | None = Field(None, ge=0)
    last_transition_time: str | None = None


class RankCoords(ApiModel):
    rank: int
    tp: int
    sp: int
    pp: int
    cfg: int
    dp: int


class Topology(ApiModel):
    world_size: int
    gpus_per_pod: int
    gpu_resource_name: str
    description: str
    rank_layout: list[RankCoords] = Field(default_factory=list)


class Failure(ApiModel):
    reason: str
    message: str = ""
    exit_code: int | None = None
    time: str | None = None


class ReplicaStatus(ApiModel):
    index: int
    pod: str
    phase: str
    ready: bool = False
    updated: bool = True
    health: Literal["Healthy", "Unhealthy", "Unreachable"] | None = None  # the operator's probe; None: not probed
    waiting: int | None = None  # from /v1/stats
    running: int | None = None
    restarts: int = 0
    recent_restarts: list[str] = Field(default_factory=list, description="restart times inside the budget window")
    last_failure: Failure | None = None
    backoff_until: str | None = None
    budget_exhausted: bool | None = None  # restarts stopped (Stalled) until the spec changes
    draining: bool | None = None  # fenced (scale-down, rollout, deletion), waiting for its in-flight requests
    message: str | None = None
    loras: list[str] | None = Field(None, description="the LoRA adapters the replica has loaded (its /v1/loras)")
    startup_seconds: dict[str, float] | None = Field(
        None, description="how long each startup phase took (fetching, loadingWeights, warmup), once ready")


class Restarts(ApiModel):
    total: int = 0


class AbortStatus(ApiModel):
    observed_id: str
    aborted: list[str] = Field(default_factory=list)
    not_found: list[str] = Field(default_factory=list)
    unreachable: list[str] = Field(default_factory=list, description="pods the abort could not reach, with why")
    completed_time: str | None = None


class AutoscalingStatus(ApiModel):
    desired_replicas: int | None = None
    metric_value: float | None = Field(None, description="total in-flight requests (waiting + running)")
    reason: str | None = None
    last_scale_time: str | None = None


class ModelStatus(ApiModel):
    """What the replicas serve: where it came from, its digest when known, and what loading it cost."""

    source: str = Field(description="builtin:NAME, path:DIR, pvc:CLAIM[/SUBPATH], image:REFERENCE or uri:URL")
    digest: str | None = Field(None, description="sha256:HEX (uri: the verified archive; image: a pinned digest)")
    size_bytes: int | None = Field(None, description="the pipeline folder on disk, as a replica measured it")
    load_seconds: float | None = Field(None, description="loading weights + warmup of the replica that measured it")


class Revision(ApiModel):
    revision: str = Field(description="the pod-template hash")
    digest: str = Field(description="sha256 of the spec that built it (first 16 hex digits)")
    generation: int
    ready_time: str | None = Field(None, description="when every replica first ran it ready")
    failed: str | None = Field(None, description="why it was rolled back")


class FailedRevision(ApiModel):
    revision: str
    reason: str
    message: str = ""
    time: str | None = None


class RolloutStatus(ApiModel):
    """Pod-template revisions: the one served now, the last that was Ready (and its spec, so a rollback
    never depends on Git), a failed one, and a short history."""

    current_revision: str | None = None
    stable_revision: str | None = None
    stable_spec: dict[str, Any] | None = Field(None, description="the spec of stableRevision")
    progress_time: str | None = Field(None, description="the rollout's start or last progress (a new replica ready)")
    updated_ready: int | None = Field(None, description="ready replicas of currentRevision at progressTime")
    failed_revision: FailedRevision | None = None
    revisions: list[Revision] = Field(default_factory=list)


class StageStatus(ApiModel):
    observed_generation: int | None = None
    phase: Phase | None = None
    conditions: list[Condition] = Field(default_factory=list)
    replicas: int = 0
    ready_replicas: int = 0
    updated_replicas: int = 0
    selector: str = ""
    template_hash: str | None = None
    topology: Topology | None = None
    replica_statuses: list[ReplicaStatus] = Field(default_factory=list)
    restarts: Restarts = Field(default_factory=Restarts)
    abort: AbortStatus | None = None
    autoscaling: AutoscalingStatus | None = None
    model: ModelStatus | None = None
    rollout: RolloutStatus | None = None
