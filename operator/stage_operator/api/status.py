"""`DiffusionStage.status` (docs/crd.md): fully typed, so the API server prunes nothing the operator writes."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from stage_operator.api.base import ApiModel

Phase = Literal["Pending", "Progressing", "Ready", "Degraded", "Stalled", "Terminating"]
ConditionType = Literal["Accepted", "Ready", "Progressing", "Degraded", "Stalled", "Compiled"]
CONDITION_TYPES: tuple[str, ...] = ("Accepted", "Ready", "Progressing", "Degraded", "Stalled", "Compiled")


class Condition(ApiModel):
    """One condition of the stage: a type, True/False/Unknown, a CamelCase reason and a message for people."""

    type: ConditionType = Field(description=(
        "Accepted, Progressing, Ready, Degraded or Stalled; Compiled with spec.compile (its mode not none)."))
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(min_length=1, description=(
        "Why, in one CamelCase word, e.g. AllReplicasReady, WaitingForGPUs, RestartBudgetExhausted (docs/crd.md)."))
    message: str = Field("", description="The details: counts, pod names, a failing pod's own error.")
    observed_generation: int | None = Field(None, ge=0, description=(
        "The metadata.generation the condition was computed for."))
    last_transition_time: str | None = Field(None, description="When `status` last changed (RFC 3339).")


class RankCoords(ApiModel):
    """One rank's coordinates in the tp-sp-pp-cfg-dp grid: rank = tp + TP·(sp + SP·(pp + PP·(cfg + CFG·dp)))."""

    rank: int = Field(description="The rank, 0 to worldSize - 1.")
    tp: int = Field(description="Its tensor-parallel index.")
    sp: int = Field(description="Its sequence-parallel index (Ulysses × ring).")
    pp: int = Field(description="Its pipeline-parallel index.")
    cfg: int = Field(description="Its CFG-parallel index (which guidance branch).")
    dp: int = Field(description="Its data-parallel index (which model copy).")


class Topology(ApiModel):
    """Each pod's engine layout, as the runtime computes it from spec.parallel and spec.resources."""

    world_size: int = Field(description="Ranks per pod: the product of the parallel degrees.")
    gpus_per_pod: int = Field(description="spec.resources.gpusPerPod: ranks per pod, GPUs or CPU processes.")
    gpu_resource_name: str = Field(description="spec.resources.gpuResourceName (\"\": CPU ranks).")
    gpus: int = Field(0, description=(
        "The GPUs each pod requests: gpusPerPod of gpuResourceName, 0 for CPU ranks (the GPUs printer column)."))
    description: str = Field(description="The topology in one line, as `stage-runtime validate` prints it.")
    rank_layout: list[RankCoords] = Field(default_factory=list, description="Every rank's coordinates.")


class Failure(ApiModel):
    """A replica's failure: its pod's exit (the termination message) or the operator's probe."""

    reason: str = Field(description=(
        "Why, in one word: the stage's own (WorkerDied, ConfigError, StartupTimeout, ChecksumMismatch, …), "
        "the kubelet's (OOMKilled, Error, Evicted) or the probe's (Unhealthy, ProbeFailed)."))
    message: str = Field("", description="The rest of the termination message, or the kubelet's or probe's words.")
    exit_code: int | None = Field(None, description=(
        "The container's exit code: 2 is a configuration error and never restarted; others are restarted. "
        "Absent for probe failures and evictions."))
    time: str | None = Field(None, description="When it failed (RFC 3339).")


class ReplicaStatus(ApiModel):
    """One replica: its pod, what it is doing, the operator's probe of it, and its restart history."""

    index: int = Field(description="The replica index; its pod is <stage>-<index>.")
    pod: str = Field(description="The pod's name.")
    phase: str = Field(description=(
        "The pod's phase (Pending, Running, Failed, …), or while it starts: Fetching, CopyingModel, "
        "BuildingModel (its init container), LoadingWeights, Warmup; Recreating while its replacement is due."))
    ready: bool = Field(False, description="The pod is ready and not terminating (it counts in readyReplicas).")
    updated: bool = Field(True, description="The pod is built from templateHash, the current revision.")
    health: Literal["Healthy", "Unhealthy", "Unreachable"] | None = Field(None, description=(
        "The operator's probe: Healthy, Unhealthy (/health answered 503) or Unreachable (no answer); absent "
        "while the pod is not running."))
    waiting: int | None = Field(None, description="Requests in the pod's waiting queue at the last probe "
                                                  "(/v1/stats).")
    running: int | None = Field(None, description="Requests running in the pod's engine at the last probe.")
    restarts: int = Field(0, description=(
        "Times the operator has restarted this replica after a failure (evictions are not counted)."))
    recent_restarts: list[Annotated[str, Field(description="A restart time (RFC 3339).")]] = Field(
        default_factory=list, description="Restart times inside restartPolicy.windowSeconds: the budget spent.")
    last_failure: Failure | None = Field(None, description="The replica's last failure.")
    backoff_until: str | None = Field(None, description="When the failed replica is recreated (RFC 3339).")
    budget_exhausted: bool | None = Field(None, description=(
        "true: restartPolicy.maxRestarts are spent; the replica is not restarted (Stalled) until the pod "
        "template or restartPolicy changes."))
    draining: bool | None = Field(None, description=(
        "true: fenced out of the Service (scale-down, rollout, deletion), finishing its requests before deletion."))
    message: str | None = Field(None, description=(
        "Why the pod is not running yet (waiting for GPUs: …, waiting for quota: scheduling gates …), or "
        "terminating."))
    loras: list[str] | None = Field(None, description="The LoRA adapters the replica has loaded (its /v1/loras).")
    sleeping: bool | None = Field(None, description=(
        "With spec.sleep: the replica is asleep (its /v1/stats at the last probe): still ready and in the Service, "
        "it wakes on the next request."))
    jobs: int | None = Field(None, description=(
        "With spec.jobs: the video jobs the replica runs now (when it drains they hand off to another replica)."))
    startup_seconds: dict[str, Annotated[float, Field(description="Seconds.")]] | None = Field(None, description=(
        "Once ready: seconds each startup phase took (fetching, copyingModel, buildingModel, loadingWeights, "
        "warmup)."))


class Restarts(ApiModel):
    """The stage's restart counters."""

    total: int = Field(0, description="Restarts the operator has decided since the stage was created.")
    policy_digest: str | None = Field(None, description="sha256 of the restartPolicy the restart budget is "
                                      "counted under (first 16 hex digits): a change resets the budget")


class AbortStatus(ApiModel):
    """The outcome of the last spec.abort the operator carried out."""

    observed_id: str = Field(description="The spec.abort.id carried out; the same id is never sent twice.")
    aborted: list[str] = Field(default_factory=list, description="The ids of the requests the pods aborted.")
    not_found: list[str] = Field(default_factory=list, description=(
        "Requested ids no pod had (finished already, or never there)."))
    unreachable: list[Annotated[str, Field(description="<pod>: <why>.")]] = Field(
        default_factory=list, description="Pods the abort could not reach, with why.")
    completed_time: str | None = Field(None, description="When the abort was sent (RFC 3339).")


class AppliedLora(ApiModel):
    """One spec.loras entry as applied on the replicas."""

    name: str = Field(description="The adapter's name.")
    path: str = Field(description="Its file or folder inside the pod.")
    pinned: bool = Field(True, description="Whether it is pinned (never evicted under maxLoras).")


class LoraSyncStatus(ApiModel):
    """spec.loras on the running replicas: changes are loaded live (no pod restart) through each ready replica's
    /v1/loras; new replicas start with `applied`."""

    applied: list[AppliedLora] = Field(default_factory=list, description=(
        "The list every ready replica holds; it becomes the spec's once every replica took the change."))
    errors: list[Annotated[str, Field(description="<pod>: <load|unload> <name>: <why>.")]] = Field(
        default_factory=list, description="What a replica refused in the last sync (a missing or unfitting file).")


class AutoscalingStatus(ApiModel):
    """The operator's last scaling decision (autoscaling.mode Operator)."""

    desired_replicas: int | None = Field(None, description=(
        "The replicas the operator runs now; spec.replicas is not written."))
    metric: str | None = Field(None, description=(
        "What the decision scaled on: inflight (requests waiting + running), cost (outstanding pixel-steps) or "
        "jobs (video jobs queued + in progress in the job store)."))
    metric_value: float | None = Field(None, description=(
        "The metric at the decision: the total over the serving replicas of in-flight requests (plus the queued "
        "video jobs with spec.jobs) or of outstanding pixel-steps; or the job store's queued + in-progress video "
        "jobs (store-wide, counted once)."))
    reason: str | None = Field(None, description="Why, in words: the load against the target over the window.")
    last_scale_time: str | None = Field(None, description="When desiredReplicas last changed (RFC 3339).")


class ModelStatus(ApiModel):
    """What the replicas serve: where it came from, its digest when known, and what loading it cost."""

    source: str = Field(description="Where it comes from: builtin:NAME, path:DIR, pvc:CLAIM[/SUBPATH], "
                                    "image:REFERENCE or uri:URL.")
    digest: str | None = Field(None, description=(
        "sha256:HEX, when known: the verified archive (uri), or the digest an image is pinned by."))
    size_bytes: int | None = Field(None, description="Bytes of the pipeline folder on disk, as a replica measured it.")
    load_seconds: float | None = Field(None, description=(
        "Seconds of loading weights + warmup of the ready, current replica that measured it."))


class Revision(ApiModel):
    """One pod-template revision the spec produced."""

    revision: str = Field(description="The pod-template hash.")
    digest: str = Field(description="sha256 of the spec that built it (first 16 hex digits).")
    generation: int = Field(description="The metadata.generation that first produced it.")
    ready_time: str | None = Field(None, description="When every replica first ran it ready (RFC 3339).")
    failed: str | None = Field(None, description="Why it was rolled back.")


class FailedRevision(ApiModel):
    """The last revision that failed its rollout and was rolled back."""

    revision: str = Field(description="Its pod-template hash.")
    reason: str = Field(description="RolloutFailed.")
    message: str = Field("", description="Why: the failing pod's own words, or the missed progress deadline.")
    time: str | None = Field(None, description="When it was rolled back (RFC 3339).")


class RolloutStatus(ApiModel):
    """Pod-template revisions: the one served now, the last that was Ready (and its spec, so a rollback
    never depends on Git), a failed one, and a short history."""

    current_revision: str | None = Field(None, description=(
        "The template hash the pods are built from now (the stable one's after a rollback)."))
    stable_revision: str | None = Field(None, description=(
        "The last revision every replica ran ready: what a failed rollout returns to."))
    stable_spec: dict[str, Any] | None = Field(None, description="The spec of stableRevision.")
    progress_time: str | None = Field(None, description=(
        "During a rollout: its start or last progress (a new replica ready), RFC 3339."))
    updated_ready: int | None = Field(None, description="During a rollout: ready replicas of currentRevision at "
                                                        "progressTime.")
    failed_revision: FailedRevision | None = None
    revisions: list[Revision] = Field(default_factory=list, description="The last 5 revisions, oldest first.")


class JobsStatus(ApiModel):
    """spec.jobs: the stage's video jobs in its store, by status, as a replica last counted them."""

    queued: int = Field(0, description="Waiting for a replica: new, or handed back at a checkpoint.")
    in_progress: int = Field(0, description="Claimed by a replica and running (or about to resume).")
    completed: int = Field(0, description="Completed, their files kept until they expire (spec.jobs.retentionSeconds).")
    failed: int = Field(0, description="Failed, kept until they expire.")


class StageStatus(ApiModel):
    """What the operator observed and did; written by the operator only, whole, when something changed."""

    observed_generation: int | None = Field(None, description=(
        "The metadata.generation this status describes; behind it, the latest spec is not reconciled yet."))
    phase: Phase | None = Field(None, description=(
        "Terminating while the stage is deleted (its pods drain first), else Stalled if Stalled, else Pending if "
        "not Accepted, else Degraded if Degraded, else Ready if Ready, else Progressing."))
    reason: str | None = Field(None, description=(
        "Why the stage is in its phase, one CamelCase word: the reason of the condition that decided the phase "
        "(Stalled's, Accepted's, Degraded's, Ready's, or Progressing's; Progressing's while Terminating). The "
        "REASON printer column (-o wide)."))
    conditions: list[Condition] = Field(default_factory=list, description=(
        "Accepted, Progressing, Ready, Degraded and Stalled, one of each; their reasons and messages say what "
        "is going on (docs/crd.md lists the reasons)."))
    replicas: int = Field(0, description="The stage's pods that are not terminating (the /scale status).")
    ready_replicas: int = Field(0, description="Of those, the ready ones.")
    updated_replicas: int = Field(0, description="Of those, the ones built from templateHash.")
    sleeping_replicas: int | None = Field(None, description=(
        "With spec.sleep: of the ready ones, those asleep at their last probe (they count as ready and wake on the "
        "next request). The SLEEPING printer column (-o wide)."))
    selector: str = Field("", description=(
        "The label selector of the stage's pods, diffstage.io/stage=<name> (for /scale, HPAs and KEDA)."))
    template_hash: str | None = Field(None, description=(
        "Hash of the pod spec and stage config a replica built now would get (the pods' "
        "diffstage.io/template-hash label); absent while the spec is invalid."))
    topology: Topology | None = None
    replica_statuses: list[ReplicaStatus] = Field(default_factory=list, description=(
        "One entry per pod of the stage, and per replica being recreated."))
    restarts: Restarts = Field(default_factory=Restarts)
    abort: AbortStatus | None = None
    lora_sync: LoraSyncStatus | None = None
    autoscaling: AutoscalingStatus | None = None
    model: ModelStatus | None = None
    rollout: RolloutStatus | None = None
    jobs: JobsStatus | None = None
    inference_pool: str | None = Field(None, description=(
        "The InferencePool (inference.networking.k8s.io/v1) the operator owns for this stage "
        "(spec.routing.inferencePool); it deletes it when that field is removed."))
