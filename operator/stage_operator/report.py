"""The stage's status, computed from what was observed and what this reconcile decided (pure)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stage_operator import conditions
from stage_operator.api.meta import selector_string, stage_selector
from stage_operator.api.status import StageStatus
from stage_operator.builders.model_delivery import model_identity
from stage_operator.capacity import Fit
from stage_operator.health import PodHealth
from stage_operator.observed import PodView
from stage_operator.restarts import ReplicaRecord, Restarts, failure_wire
from stage_operator.rollout import Decisions
from stage_operator.stage import Stage


@dataclass(frozen=True)
class Extras:
    """What the steps beside the rollout decided: restarts, probe results, abort, autoscaling."""

    members: Sequence[int] = ()  # the replica indices that should exist
    restarts: Restarts = field(default_factory=Restarts)
    health: Mapping[str, PodHealth] = field(default_factory=dict)  # by pod uid
    abort: dict[str, Any] | None = None  # the new status.abort, None: keep the last
    autoscaling: dict[str, Any] | None = None  # the new status.autoscaling, None: keep the last
    rollout: dict[str, Any] | None = None  # the new status.rollout (revisions), None: keep the last
    rollout_failed: tuple[str, str] | None = None  # (reason, message): rolled back from a failed revision
    quota_refused: Mapping[str, str] = field(default_factory=dict)  # pods a ResourceQuota refused to create


INIT_PHASES = {"fetch-model": ("Fetching", "fetching"), "copy-model": ("CopyingModel", "copyingModel"),
               "make-model": ("BuildingModel", "buildingModel")}
LOADING_PHASES = {"loading_weights": ("LoadingWeights", "loadingWeights"), "warmup": ("Warmup", "warmup")}
STARTUP_PHASES = {p for p, _ in (*INIT_PHASES.values(), *LOADING_PHASES.values())}


def replica_phase(pod: PodView, health: PodHealth | None) -> str:
    """The pod's phase, or while it starts what it is doing: Fetching (its fetch-model init container),
    CopyingModel, BuildingModel, then LoadingWeights and Warmup as the stage reports them."""
    if pod.phase == "Pending" and pod.init_running in INIT_PHASES:
        return INIT_PHASES[pod.init_running][0]
    if pod.running and not pod.ready and health is not None and health.loading_phase in LOADING_PHASES:
        return LOADING_PHASES[health.loading_phase][0]
    return pod.phase


def startup_seconds(pod: PodView, health: PodHealth | None) -> dict[str, float]:
    """How long each startup phase took (init containers from the kubelet, loading from the stage)."""
    out = {INIT_PHASES[name][1]: s for name, s in pod.init_seconds.items() if name in INIT_PHASES}
    phases = ((health.startup or {}).get("phases") or {}) if health is not None else {}
    out.update({LOADING_PHASES[k][1]: float(v) for k, v in phases.items() if k in LOADING_PHASES})
    return out


def _model_status(stage: Stage, pods: dict[int, PodView], desired_hash: str | None,
                  health: Mapping[str, PodHealth]) -> dict[str, Any]:
    """status.model: identity from the spec; size and load time from the first ready, current replica that
    reported them (else what the last status said of the same source)."""
    out = model_identity(stage.spec)
    for pod in pods.values():
        h = health.get(pod.uid)
        startup = (h.startup or {}) if h is not None else {}
        if pod.available and pod.template_hash == desired_hash and startup.get("phases"):
            if startup.get("model_bytes") is not None:
                out["sizeBytes"] = int(startup["model_bytes"])
            out["loadSeconds"] = round(sum(float(v) for k, v in startup["phases"].items() if k in LOADING_PHASES), 3)
            return out
    before = stage.status.get("model") or {}
    if before.get("source") == out["source"]:
        out.update({k: before[k] for k in ("sizeBytes", "loadSeconds") if k in before})
    return out


def _replica_status(pod: PodView, desired_hash: str | None, record: ReplicaRecord,
                    health: PodHealth | None) -> dict[str, Any]:
    out: dict[str, Any] = {"index": pod.index, "pod": pod.name, "phase": replica_phase(pod, health),
                           "ready": pod.available, "updated": pod.template_hash == desired_hash, **record.wire()}
    if pod.available and (took := startup_seconds(pod, health)):
        out["startupSeconds"] = took
    if pod.terminating:
        out["message"] = "terminating"
    elif pod.gated:
        out["message"] = f"waiting for quota: scheduling gates {', '.join(pod.gated)}"
    elif pod.unschedulable:
        out["message"] = f"waiting for GPUs: {pod.unschedulable}"
    elif health is not None and health.state == "stalled":      # the step watchdog: out of the Service for now
        out["message"] = ("stalled: a running step makes no progress (unready until it moves; failed closed past "
                          "engine.limits.stallFailSeconds)")
    if pod.draining_since is not None and not pod.terminating:
        out["draining"] = True
    if health is not None and pod.running:
        out["health"] = health.health
        if health.in_flight is not None:
            out["waiting"], out["running"] = health.waiting, health.running
        if health.loras is not None:
            out["loras"] = list(health.loras)
        if health.jobs is not None:
            out["jobs"] = health.jobs_here
        if health.sleep is not None:
            out["sleeping"] = health.sleeping
    return out


def _jobs_status(pods: dict[int, PodView], health: Mapping[str, PodHealth],
                 previous: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """status.jobs: the counts the lowest-numbered running pod reported at its last probe (every replica counts the
    same store; one source keeps the status from flapping between replicas' scans), else the last status's (no
    replica runs now)."""
    seen = [(p.index, h.jobs) for p in pods.values() if p.running and not p.terminating
            and (h := health.get(p.uid)) is not None and h.jobs is not None]
    if not seen:
        return dict(previous) if previous else None
    jobs = min(seen, key=lambda seen: seen[0])[1]
    return {"queued": jobs["queued"], "inProgress": jobs["in_progress"], "completed": jobs["completed"],
            "failed": jobs["failed"]}


NOT_REPORTED = ("no ready replica of the current revision has reported its compile yet (a replica compiles while it "
                "warms up, before it is ready)")


def _compiled_line(pod: str, c: Mapping[str, Any]) -> str:
    parts = [str(c["mode_effective"])]
    if c.get("graphs") is not None:
        parts.append(f"{c['graphs']} graphs")
    if c.get("recompiles") is not None:
        parts.append(f"{c['recompiles']} recompiles")
    if c.get("cold_compile_s") is not None:
        parts.append(f"cold compile {c['cold_compile_s']:.1f} s")
    if c.get("cache"):
        parts.append(f"cache {c['cache']}")
    if c.get("graph_limit_reached"):
        parts.append("graph limit reached (new shapes run eagerly)")
    return f"{pod}: {', '.join(parts)}"


def _compiled(stage: Stage, pods: dict[int, PodView], desired_hash: str | None,
              health: Mapping[str, PodHealth]) -> dict[str, Any] | None:
    """The Compiled condition (None: spec.compile is off): from what the ready replicas of the current revision say in
    /v1/stats.compile. False when any serves eagerly: CompileFallback (a compile error or the warm-up past its
    timeout, with the runtime's reason) or AutoChoseEager (mode auto found no faster mode for the family on this
    device, with the measurement it followed); the replica still serves, eagerly. True (Compiled) when every one of
    them compiled; Unknown until they have all reported (the last verdict on the same revision is kept while none
    has, e.g. after an operator restart)."""
    spec = stage.spec.compile
    if spec is None or not spec.enabled:
        return None
    ready = [p for p in pods.values() if p.available and p.template_hash == desired_hash]
    reports = {p.name: c for p in ready if (h := health.get(p.uid)) is not None and (c := h.compile) is not None}
    eager = {name: c for name, c in reports.items() if c["mode_effective"] == "none"}
    if fell_back := {name: c for name, c in eager.items() if c.get("reason") or not c.get("auto")}:
        why = "; ".join(f"{name}: {c.get('reason') or 'no reason given'}" for name, c in sorted(fell_back.items()))
        return conditions.condition("Compiled", False, "CompileFallback",
                                    f"{len(fell_back)}/{len(ready)} ready replicas fell back to eager: {why}")
    if eager:
        why = "; ".join(sorted({str(c["auto"]) for c in eager.values()}))
        return conditions.condition("Compiled", False, "AutoChoseEager",
                                    f"{len(eager)}/{len(ready)} ready replicas run eagerly, as compile.mode auto "
                                    f"chose: {why}")
    if ready and len(reports) == len(ready):
        return conditions.condition("Compiled", True, "Compiled",
                                    "; ".join(_compiled_line(name, c) for name, c in sorted(reports.items())))
    before = next((c for c in stage.status.get("conditions") or () if c.get("type") == "Compiled"), None)
    if not reports and before and before.get("status") != "Unknown" and stage.status.get("templateHash") == desired_hash:
        return {k: before[k] for k in ("type", "status", "reason", "message") if k in before}
    message = f"{len(reports)}/{len(ready)} ready replicas reported: {NOT_REPORTED}" if reports else NOT_REPORTED
    return {"type": "Compiled", "status": "Unknown", "reason": "NotReported", "message": message}


def _failure_line(name: str, f: Mapping[str, Any]) -> str:
    code = f" (exit code {f['exitCode']})" if f.get("exitCode") is not None else ""
    return f"{name}: {f['reason']}{code}" + (f": {f['message']}" if f.get("message") else "")


def _topology(stage: Stage) -> dict[str, Any]:
    parallel, resources = stage.spec.topology(), stage.spec.resources
    return {"worldSize": parallel.world_size, "gpusPerPod": resources.gpus_per_pod,
            "gpuResourceName": resources.gpu_resource_name,
            "gpus": resources.gpus_per_pod if resources.gpu_resource_name else 0, "description": parallel.describe(),
            "rankLayout": [c._asdict() for c in parallel.rank_layout()]}


def _progressing(members: Sequence[int], pods: dict[int, PodView], desired_hash: str,
                 decisions: Decisions, quota_refused: Mapping[str, str] | None = None) -> dict[str, Any]:
    replicas = len(members)
    current = [p for i, p in pods.items() if i in members]
    waiting = [p.name for p in current if p.unschedulable]
    outdated = [p for p in current if p.template_hash != desired_hash]
    extra = [p for i, p in pods.items() if i not in members]
    not_ready = sum(1 for i in members if i not in pods or not pods[i].available)
    names = {p.name for p in current}
    if refused := [f"{name}: {why}" for name, why in sorted((quota_refused or {}).items()) if name not in names]:
        return conditions.condition("Progressing", True, "WaitingForQuota", f"refused by quota: {'; '.join(refused)}")
    if gated := [f"{p.name} ({', '.join(p.gated)})" for p in current if p.gated]:
        return conditions.condition("Progressing", True, "WaitingForQuota",
                                    f"held by scheduling gates (queue admission or quota): {'; '.join(gated)}")
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


def phase_of(new: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    """The phase and the reason of the condition that decided it (status.reason, the REASON column): Stalled,
    else Pending (not Accepted), else Degraded, else Ready, else Progressing (its reason while it is True, else
    Ready's: why not ready)."""
    by_type = {c["type"]: c for c in new}
    if by_type["Stalled"]["status"] == "True":
        return "Stalled", by_type["Stalled"]["reason"]
    if by_type["Accepted"]["status"] == "False":
        return "Pending", by_type["Accepted"]["reason"]
    if by_type["Degraded"]["status"] == "True":
        return "Degraded", by_type["Degraded"]["reason"]
    if by_type["Ready"]["status"] == "True":
        return "Ready", by_type["Ready"]["reason"]
    progressing = by_type["Progressing"]
    return "Progressing", progressing["reason"] if progressing["status"] == "True" else by_type["Ready"]["reason"]


def build_status(stage: Stage, pods: dict[int, PodView], fit: Fit, decisions: Decisions, desired_hash: str | None,
                 now: str, extras: Extras | None = None) -> dict[str, Any]:
    """The whole status (wire form). `desired_hash` is None when the spec is invalid."""
    extras = extras or Extras(members=range(stage.spec.replicas) if stage.spec else ())
    previous, records, stalled = dict(stage.status), extras.restarts.records, extras.restarts.stalled
    live = [p for p in pods.values() if not p.terminating]
    ready = sum(1 for p in live if p.available)
    failed = [(pods[i].name, records[i].last_failure) for i in sorted(extras.restarts.failing)]
    failed += [(p.name, failure_wire(p.failure)) for p in live if p.failure and p.index not in extras.restarts.failing]
    replicas = len(extras.members)
    new: list[dict[str, Any]] = []
    if stage.spec is None:
        new += [conditions.condition("Accepted", False, "InvalidSpec", stage.error or "invalid spec"),
                conditions.condition("Stalled", True, "InvalidSpec", "fix the spec; nothing is created until then"),
                conditions.condition("Progressing", False, "InvalidSpec", "")]
    else:
        new.append(conditions.condition("Accepted", True, "TopologyValid", stage.spec.topology().describe())
                   if fit.ok else conditions.condition("Accepted", False, fit.reason, fit.message))
        new.append(conditions.condition("Stalled", True, *stalled) if stalled else
                   conditions.condition("Stalled", False, "NotStalled", ""))
        progressing = _progressing(extras.members, pods, desired_hash, decisions,
                                   extras.quota_refused) if fit.ok else \
            conditions.condition("Progressing", False, fit.reason, fit.waiting)
        if extras.rollout_failed and progressing["reason"] == "Complete":  # halted: the old revision serves
            progressing = conditions.condition("Progressing", False, *extras.rollout_failed)
        new.append(progressing)
    all_ready = stage.spec is not None and ready == replicas and all(
        p.template_hash == desired_hash for p in live) and len(live) == replicas
    new.append(conditions.condition("Ready", all_ready, "ScaledToZero" if all_ready and not replicas else
                                    "AllReplicasReady" if all_ready else "ReplicasNotReady",
                                    f"{ready}/{replicas} replicas ready"))
    new.append(conditions.condition("Degraded", True, *extras.rollout_failed) if extras.rollout_failed else
               conditions.condition("Degraded", bool(failed), "ReplicaFailed" if failed else "NoFailures",
                                    "; ".join(_failure_line(name, f) for name, f in failed if f)))
    if stage.spec is not None and (compiled := _compiled(stage, pods, desired_hash, extras.health)) is not None:
        new.append(compiled)
    phase, reason = phase_of(new)
    statuses = [_replica_status(p, desired_hash, records.get(p.index, ReplicaRecord()), extras.health.get(p.uid))
                for p in pods.values()]
    for r in previous.get("replicaStatuses") or ():  # a replica being recreated keeps its history
        if int(r["index"]) in extras.members and int(r["index"]) not in pods and r.get("restarts"):
            statuses.append({**{k: r[k] for k in ("index", "pod", "restarts", "recentRestarts", "lastFailure")
                                if k in r}, "phase": "Recreating"})
    total = int((previous.get("restarts") or {}).get("total", 0)) + extras.restarts.added
    status: dict[str, Any] = {
        "observedGeneration": stage.generation, "phase": phase, "reason": reason,
        "conditions": conditions.merge(previous.get("conditions") or (), new, stage.generation, now),
        "replicas": len(live), "readyReplicas": ready,
        "updatedReplicas": sum(1 for p in live if p.template_hash == desired_hash),
        "selector": selector_string(stage_selector(stage.name)),
        "replicaStatuses": sorted(statuses, key=lambda r: r["index"]),
        "restarts": {"total": total, "policyDigest": extras.restarts.policy_digest},  # None: dropped by wire()
    }
    if desired_hash:
        status["templateHash"] = desired_hash
    if stage.spec is not None:
        status["topology"] = _topology(stage)
        status["model"] = _model_status(stage, pods, desired_hash, extras.health)
        if stage.spec.jobs is not None:
            status["jobs"] = _jobs_status(pods, extras.health, previous.get("jobs"))
        if stage.spec.sleep is not None:  # asleep and Ready: counted in readyReplicas too (a request wakes it)
            status["sleepingReplicas"] = sum(1 for p in live if p.available and (h := extras.health.get(p.uid))
                                             is not None and h.sleeping)
    for key, value in (("abort", extras.abort), ("autoscaling", extras.autoscaling), ("rollout", extras.rollout)):
        if value is not None or key in previous:
            status[key] = value if value is not None else previous[key]
    return StageStatus.model_validate(status).wire()  # the typed status is the contract: fail here, not in the API


def build_deleting_status(stage: Stage, pods: dict[int, PodView], leaving: Collection[str], fenced: Collection[str],
                          now: str) -> dict[str, Any]:
    """The status while the stage is deleted and its pods drain (`leaving`: deleted by this reconcile; `fenced`:
    fenced by it): phase Terminating, Ready=False (Terminating: no pod is in the Service any more),
    Progressing=True (Draining, naming the pods still finishing their requests), the counts of the pods still
    there; everything else as it was. It changes only when the deletion starts and when a pod leaves."""
    previous = dict(stage.status)
    live = [p for p in pods.values() if not p.terminating and p.name not in leaving]
    names = {p.name: p for p in live}
    left = f"draining {', '.join(names)}" if names else "every pod has drained"
    new = [{k: c[k] for k in ("type", "status", "reason", "message") if k in c}
           for c in previous.get("conditions") or () if c.get("type") not in ("Ready", "Progressing")]
    new += [conditions.condition("Ready", False, "Terminating",
                                 "the stage is being deleted: its pods left the Service"),
            conditions.condition("Progressing", True, "Draining", f"the stage is being deleted: {left}")]
    statuses = []
    for r in previous.get("replicaStatuses") or ():
        if (pod := names.get(r.get("pod"))) is not None:
            statuses.append({**r, "draining": True} if pod.draining_since is not None or pod.name in fenced else r)
    status = {**previous, "observedGeneration": stage.generation, "phase": "Terminating", "reason": "Draining",
              "conditions": conditions.merge(previous.get("conditions") or (), new, stage.generation, now),
              "replicas": len(live), "readyReplicas": sum(1 for p in live if p.available),
              "updatedReplicas": sum(1 for p in live if p.template_hash == previous.get("templateHash")),
              "replicaStatuses": statuses}
    return StageStatus.model_validate(status).wire()
