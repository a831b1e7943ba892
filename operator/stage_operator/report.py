"""The stage's status, computed from what was observed and what this reconcile decided (pure)."""

from __future__ import annotations

from typing import Any

from stage_operator import conditions
from stage_operator.api.meta import selector_string, stage_selector
from stage_operator.api.status import StageStatus
from stage_operator.capacity import Fit
from stage_operator.observed import PodView
from stage_operator.rollout import Decisions
from stage_operator.stage import Stage

_CARRIED = ("abort", "autoscaling")  # written by the abort and autoscaling steps: kept as they are


def _replica_status(pod: PodView, desired_hash: str | None, previous: dict[int, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"index": pod.index, "pod": pod.name, "phase": pod.phase, "ready": pod.available,
                           "updated": pod.template_hash == desired_hash,
                           "restarts": int(previous.get(pod.index, {}).get("restarts", 0))}
    if pod.terminating:
        out["message"] = "terminating"
    elif pod.unschedulable:
        out["message"] = f"waiting for GPUs: {pod.unschedulable}"
    if pod.failure:
        f = pod.failure
        out["lastFailure"] = {k: v for k, v in (("reason", f.reason), ("message", f.message),
                                                 ("exitCode", f.exit_code), ("time", f.time)) if v is not None}
    return out


def _failure_line(pod: PodView) -> str:
    f = pod.failure
    code = f" (exit code {f.exit_code})" if f.exit_code is not None else ""
    return f"{pod.name}: {f.reason}{code}" + (f": {f.message}" if f.message else "")


def _topology(stage: Stage) -> dict[str, Any]:
    parallel, resources = stage.spec.topology(), stage.spec.resources
    return {"worldSize": parallel.world_size, "gpusPerPod": resources.gpus_per_pod,
            "gpuResourceName": resources.gpu_resource_name, "description": parallel.describe(),
            "rankLayout": [c._asdict() for c in parallel.rank_layout()]}


def _progressing(replicas: int, pods: dict[int, PodView], desired_hash: str, decisions: Decisions) -> dict[str, Any]:
    current = [p for i, p in pods.items() if i < replicas]
    waiting = [p.name for p in current if p.unschedulable]
    outdated = [p for p in current if p.template_hash != desired_hash]
    extra = [p for i, p in pods.items() if i >= replicas]
    not_ready = sum(1 for i in range(replicas) if i not in pods or not pods[i].available)
    if waiting:
        return conditions.condition("Progressing", True, "WaitingForGPUs",
                                    f"unschedulable, waiting for capacity: {', '.join(waiting)}")
    if outdated:
        return conditions.condition("Progressing", True, "RollingUpdate",
                                    f"{replicas - len(outdated)}/{replicas} replicas updated")
    if extra:
        return conditions.condition("Progressing", True, "ScalingDown", f"removing {', '.join(p.name for p in extra)}")
    if decisions.create or not_ready:
        return conditions.condition("Progressing", True, "ReplicasStarting",
                                    f"{replicas - not_ready}/{replicas} replicas ready")
    return conditions.condition("Progressing", False, "Complete", f"{replicas}/{replicas} replicas updated and ready")


def build_status(stage: Stage, pods: dict[int, PodView], fit: Fit, decisions: Decisions, desired_hash: str | None,
                 now: str) -> dict[str, Any]:
    """The whole status (wire form). `desired_hash` is None when the spec is invalid."""
    previous = dict(stage.status)
    live = [p for p in pods.values() if not p.terminating]
    ready = sum(1 for p in live if p.available)
    failed = [p for p in live if p.failure]
    replicas = stage.spec.replicas if stage.spec else 0
    new: list[dict[str, Any]] = []
    if stage.spec is None:
        new += [conditions.condition("Accepted", False, "InvalidSpec", stage.error or "invalid spec"),
                conditions.condition("Stalled", True, "InvalidSpec", "fix the spec; nothing is created until then"),
                conditions.condition("Progressing", False, "InvalidSpec", "")]
    else:
        new.append(conditions.condition("Accepted", True, "TopologyValid", stage.spec.topology().describe())
                   if fit.ok else conditions.condition("Accepted", False, "InsufficientGPUCapacity", fit.message))
        new.append(conditions.condition("Stalled", False, "NotStalled", ""))
        new.append(_progressing(replicas, pods, desired_hash, decisions) if fit.ok else conditions.condition(
            "Progressing", False, "InsufficientGPUCapacity", "waiting for a node that fits"))
    all_ready = stage.spec is not None and ready == replicas and all(
        p.template_hash == desired_hash for p in live) and len(live) == replicas
    new.append(conditions.condition("Ready", all_ready, "ScaledToZero" if all_ready and not replicas else
                                    "AllReplicasReady" if all_ready else "ReplicasNotReady",
                                    f"{ready}/{replicas} replicas ready"))
    new.append(conditions.condition("Degraded", bool(failed), "ReplicaFailed" if failed else "NoFailures",
                                    "; ".join(_failure_line(p) for p in failed)))
    by_type = {c["type"]: c["status"] == "True" for c in new}
    phase = ("Stalled" if by_type["Stalled"] else "Pending" if not by_type["Accepted"] else
             "Degraded" if by_type["Degraded"] else "Ready" if by_type["Ready"] else "Progressing")
    prev_replicas = {int(r.get("index", -1)): r for r in previous.get("replicaStatuses") or ()}
    status: dict[str, Any] = {
        "observedGeneration": stage.generation, "phase": phase,
        "conditions": conditions.merge(previous.get("conditions") or (), new, stage.generation, now),
        "replicas": len(live), "readyReplicas": ready,
        "updatedReplicas": sum(1 for p in live if p.template_hash == desired_hash),
        "selector": selector_string(stage_selector(stage.name)),
        "replicaStatuses": [_replica_status(p, desired_hash, prev_replicas) for p in pods.values()],
        "restarts": previous.get("restarts") or {"total": 0},  # counted by the restart policy
    }
    if desired_hash:
        status["templateHash"] = desired_hash
    if stage.spec is not None:
        status["topology"] = _topology(stage)
    status.update({k: previous[k] for k in _CARRIED if k in previous})
    return StageStatus.model_validate(status).wire()  # the typed status is the contract: fail here, not in the API
