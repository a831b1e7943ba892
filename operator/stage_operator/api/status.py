"""`DiffusionStage.status` (DESIGN.md §4): fully typed, so the API server prunes nothing the operator writes."""

from __future__ import annotations

from typing import Literal

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
    health: str | None = None  # from /health, polled by the health daemon (issue 7)
    waiting: int | None = None  # from /v1/stats (issue 7)
    running: int | None = None
    restarts: int = 0
    last_failure: Failure | None = None
    backoff_until: str | None = None
    message: str | None = None


class Restarts(ApiModel):
    total: int = 0


class AbortStatus(ApiModel):
    observed_id: str
    aborted: list[str] = Field(default_factory=list)
    not_found: list[str] = Field(default_factory=list)
    completed_time: str | None = None


class AutoscalingStatus(ApiModel):
    desired_replicas: int | None = None
    metric_value: float | None = None
    reason: str | None = None
    last_scale_time: str | None = None


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
