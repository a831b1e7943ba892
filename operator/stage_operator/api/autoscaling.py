"""`spec.autoscaling`: who owns `replicas` (you, an HPA/KEDA through /scale, or the operator) and, in Operator
mode, what the operator scales on (`autoscale.py` decides). Its CEL rules live here, on the type they guard."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from stage_operator.api.base import ApiModel, cel

_CAMEL = ApiModel.model_config

_OPERATOR_ONLY = ("minReplicas", "maxReplicas", "metric", "targetInFlightPerReplica", "targetCostPerReplica",
                  "targetJobsPerReplica", "scaleUpStabilizationSeconds", "scaleDownStabilizationSeconds")
COST_NEEDS_TARGET = ("autoscaling.metric cost needs targetCostPerReplica: the outstanding pixel-steps (remaining "
                     "steps x pixels x frames x outputs) one replica should hold, e.g. 52428800 for one 1024x1024 "
                     "50-step request")
TARGET_NEEDS_COST = "autoscaling.targetCostPerReplica applies only with metric cost"
TARGET_NEEDS_JOBS = "autoscaling.targetJobsPerReplica applies only with metric jobs"
JOBS_NEED_STORE = ("autoscaling.metric jobs needs spec.jobs: it counts the video jobs queued and in progress in the "
                   "job store, and a stage without spec.jobs has no store")  # no quote: a CEL string literal
# On StageSpec (it reads spec.jobs beside spec.autoscaling); StageSpec's validator says the same.
JOBS_NEED_STORE_RULE = cel(
    "!has(self.autoscaling) || !has(self.autoscaling.metric) || self.autoscaling.metric != 'jobs' || has(self.jobs)",
    f"'{JOBS_NEED_STORE}'")


SCALE_TO_ZERO = ("autoscaling.minReplicas 0 is refused with mode Operator: a stage at 0 has no pod to probe, so "
                 "nothing would scale it back up; use mode External with KEDA (its HTTP add-on holds requests "
                 "and scales 0 to 1 through /scale), or set minReplicas >= 1")


class Autoscaling(ApiModel):
    """Who owns `replicas`: None (you), External (HPA/KEDA through /scale), Operator (the operator)."""

    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": [
        cel("self.mode == 'Operator' || !(" + " || ".join(f"has(self.{f})" for f in _OPERATOR_ONLY) + ")",
            "'autoscaling.mode is ' + self.mode + ': " + ", ".join(_OPERATOR_ONLY)
            + " apply only with mode Operator'"),
        cel("self.mode != 'Operator' || has(self.maxReplicas)",
            "'autoscaling.mode Operator needs maxReplicas'"),
        cel("!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
            "'autoscaling.minReplicas (' + string(self.minReplicas) + ') must not exceed maxReplicas ('"
            " + string(self.maxReplicas) + ')'"),
        cel("self.mode != 'Operator' || !has(self.minReplicas) || self.minReplicas >= 1", f"'{SCALE_TO_ZERO}'"),
        cel("!has(self.metric) || self.metric != 'cost' || has(self.targetCostPerReplica)", f"'{COST_NEEDS_TARGET}'"),
        cel("!has(self.targetCostPerReplica) || (has(self.metric) && self.metric == 'cost')",
            f"'{TARGET_NEEDS_COST}'"),
        cel("!has(self.targetJobsPerReplica) || (has(self.metric) && self.metric == 'jobs')",
            f"'{TARGET_NEEDS_JOBS}'"),
    ]})
    mode: Literal["None", "External", "Operator"] = Field("None", description=(
        "None (default): spec.replicas is yours; External: an HPA or KEDA scales through /scale; Operator: the "
        "operator scales on the in-flight requests its probe sees (status.autoscaling), never writing replicas."))
    min_replicas: int | None = Field(None, ge=0, description=(
        "Operator mode: the fewest replicas (default 1). 0 is refused: nothing could scale the stage back up."))
    max_replicas: int | None = Field(None, ge=1, description=(
        "Operator mode, required there: the most replicas (at least minReplicas)."))
    metric: Literal["inflight", "cost", "jobs"] | None = Field(None, description=(
        "Operator mode: what to scale on. inflight (default): requests waiting + running; cost: their outstanding "
        "work in pixel-steps (remaining steps x pixels x frames x outputs, each replica's /v1/stats cost), so a few "
        "large requests scale out where as many small ones would not; jobs (needs spec.jobs): the video jobs "
        "queued + in progress in the stage's job store (/v1/stats jobs, store-wide: counted once, never summed "
        "over the replicas)."))
    target_in_flight_per_replica: int | None = Field(None, ge=1, description=(
        "Operator mode, metric inflight: in-flight requests (waiting + running) per replica to aim for: desired "
        "replicas = ceil(in flight / this). Default: engine.maxNumSeqs."))
    target_cost_per_replica: int | None = Field(None, ge=1, description=(
        "Operator mode, metric cost (required there): outstanding pixel-steps per replica to aim for: desired "
        "replicas = ceil(total outstanding / this). One 1024x1024 50-step image is 52428800."))
    target_jobs_per_replica: int | None = Field(None, ge=1, description=(
        "Operator mode, metric jobs: video jobs (queued + in progress) per replica to aim for: desired replicas = "
        "ceil(jobs / this). A replica runs up to engine.maxNumSeqs jobs at once (it claims that many from the "
        "store), so the default is engine.maxNumSeqs: 1 by default, one job per replica; a lower value starts "
        "replicas that find the jobs already claimed."))
    scale_up_stabilization_seconds: int | None = Field(None, ge=0, description=(
        "Operator mode: scale up only to the smallest recommendation seen over this many seconds (default 0: "
        "at once)."))
    scale_down_stabilization_seconds: int | None = Field(None, ge=0, description=(
        "Operator mode: scale down only to the largest recommendation seen over this many seconds (default 300)."))
    drain_timeout_seconds: int = Field(60, ge=0, description=(
        "Seconds a removed replica (scale-down, rollout, the stage's deletion; any mode) may finish its requests "
        "before it is deleted (default 60); also the stage's --drain-timeout. Pod grace period: 5 + this + 10 s."))

    @model_validator(mode="after")
    def _wakes_up(self) -> Autoscaling:
        if self.mode == "Operator" and self.min_replicas == 0:
            raise ValueError(SCALE_TO_ZERO)
        if self.metric == "cost" and self.target_cost_per_replica is None:
            raise ValueError(COST_NEEDS_TARGET)
        if self.target_cost_per_replica is not None and self.metric != "cost":
            raise ValueError(TARGET_NEEDS_COST)
        if self.target_jobs_per_replica is not None and self.metric != "jobs":
            raise ValueError(TARGET_NEEDS_JOBS)
        return self
