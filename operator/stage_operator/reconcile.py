"""`reconcile(stage, observed) -> Plan`: level-based and pure. Nothing changed → an empty plan (zero writes).

Steps: parse (done: `Stage`) → capacity (`capacity.check`) → how many replicas (`spec.replicas`, or under
operator autoscaling `autoscale.decide`) → which revision builds the pods (`rollback.decide`: the spec's, or
the last Ready one after a failed rollout) → which replicas exist (`rollout.members_wanted`: the surge;
`scaledown.plan`: least-loaded victims) → pod decisions (`rollout.decide`) → the restart policy on failed pods
(`restarts.decide`: fence, backoff, recreate or Stalled; evictions at once) → children (ConfigMap, Service,
PodDisruptionBudget, NetworkPolicy) → status (`report.build_status`, with the probe results and the abort outcome the
controller observed) → Events for what changed. One writer: the plan. Every pod that leaves goes through
`drain.py` (fenced, deleted once idle), including when the stage itself is deleted.
"""

from __future__ import annotations

from typing import Any

from stage_operator import (autoscale, capacity, drain, jobs_store, lora_sync, report, restarts, rollback, rollout,
                            scaledown)
from stage_operator.api.meta import LABEL_SERVING
from stage_operator.builders.children import build_configmap, build_service
from stage_operator.builders.disruption import build_pdb, pdb_name
from stage_operator.builders.event import build_event
from stage_operator.builders.inference_pool import build_inference_pool, inference_pool_name
from stage_operator.builders.networkpolicy import build_network_policy, network_policy_name
from stage_operator.builders.pod import build_pod
from stage_operator.observed import Observed, PodView
from stage_operator.plan import Delete, Patch, Plan, contains, merge_patch
from stage_operator.stage import Stage

FENCE = {"metadata": {"labels": {LABEL_SERVING: "false"}}}


def needs_nodes(stage: Stage, observed: Observed) -> bool:
    """Whether the capacity check needs the node list (and, with device claims, the DRA inventory): GPUs or devices
    requested and replicas to create or a failed check."""
    if stage.spec is None or stage.deleting or not (stage.spec.resources.gpu_resource_name
                                                    or stage.spec.pod_template.resource_claims):
        return False
    pods = observed.pod_views()
    replicas = stage.spec.replicas
    if stage.spec.autoscaling.mode == "Operator":  # the operator's own decision, not spec.replicas
        replicas = int((stage.status.get("autoscaling") or {}).get("desiredReplicas", replicas))
    missing = len([p for p in pods.values() if not p.terminating]) < replicas
    accepted = next((c for c in stage.status.get("conditions") or () if c.get("type") == "Accepted"), None)
    rolling = stage.generation != stage.status.get("observedGeneration") or any(
        p.template_hash != stage.status.get("templateHash") for p in pods.values())
    surge = stage.spec.rollout.max_surge > 0 and rolling  # a surge pod needs a node that fits
    return missing or surge or bool(accepted and accepted.get("status") == "False")


def _child(kind: str, desired: dict[str, Any], observed: Any, owned: tuple[str, ...], plan: Plan) -> None:
    if observed is None:
        plan.create.append(desired)
        return
    wanted = {"metadata": {"labels": desired["metadata"]["labels"]}, **{k: desired[k] for k in owned}}
    if not contains(observed, wanted):
        plan.patch.append(Patch(kind, desired["metadata"]["name"], wanted))


def _soonest(*delays: float | None) -> float | None:
    known = [d for d in delays if d is not None]
    return min(known) if known else None


def reconcile(stage: Stage, observed: Observed) -> Plan:
    plan = Plan()
    pods, now = observed.pod_views(), observed.epoch
    if stage.deleting:  # drain every pod first; garbage collection then removes the other children
        return _deleting(stage, observed, pods, now)
    spec, desired_hash = stage.spec, None
    fit = capacity.Fit(True)
    decisions = rollout.Decisions()
    extras = report.Extras(abort=observed.abort)
    events: list[tuple[str, str, str]] = []
    requeue = None
    if spec is not None:
        fit = jobs_store.check(spec.jobs, observed.jobs_claim, stage.namespace)
        fit = capacity.check(spec.resources, observed.nodes, spec.pod_template.resource_claims or (),
                             observed.dra) if fit.ok else fit  # no claim: no pod, GPUs or not
        desired, autoscaling = spec.replicas, None
        if spec.autoscaling.mode == "Operator":  # the operator's own decision instead of spec.replicas
            desired, autoscaling, event = autoscale.decide(spec, stage.status.get("autoscaling"),
                                                           observed.load_samples, now)
            events += [event] if event else []
        # Which revision the pods are built from: the spec's, or the last Ready one after a failed rollout.
        target = rollback.decide(stage, pods, desired, now, observed.image_volumes)
        template, desired_hash = target.template, target.desired_hash
        drain_timeout = spec.autoscaling.drain_timeout_seconds
        # Every removal (kubectl scale, an HPA, the operator's autoscaler, a rollout) goes through the one drain:
        # fenced, deleted once idle. No request is lost to it.
        count = rollout.members_wanted(desired, pods, desired_hash, spec.rollout, allow_surge=fit.ok)
        scaled = scaledown.plan(count, pods, observed.health, drain_timeout, now, desired_hash)
        members, kept = scaled.members, scaled.kept
        decisions = rollout.decide(members, kept, desired_hash, allow_create=fit.ok, policy=spec.rollout,
                                   desired=desired, health=observed.health, now=now, drain_timeout=drain_timeout)
        for drained in (scaled, decisions.drains):
            plan.patch.extend(Patch("Pod", name, body) for name, body in drained.patch)
            plan.delete.extend(Delete("Pod", name, why) for name, why in drained.delete)
            events += drained.events
        rs = restarts.decide(spec.restart_policy, stage.status, kept, observed.health,
                             spec.health_check.failure_threshold, desired_hash, now)
        extras = report.Extras(members, rs, observed.health, observed.abort, autoscaling, target.status, target.failed,
                               quota_refused=observed.quota_refused)
        requeue = _soonest(scaled.requeue_after, decisions.drains.requeue_after, rs.requeue_after,
                           target.requeue_after,
                           jobs_store.RECHECK_SECONDS if fit.reason == jobs_store.MISSING else None, fit.recheck)
        applied = (observed.lora_sync.applied if observed.lora_sync is not None
                   else lora_sync.applied(stage.status, spec.loras))
        if fit.ok or observed.configmap is not None:   # new replicas start with the LoRA list applied everywhere
            _child("ConfigMap", build_configmap(template, applied), observed.configmap, ("data",), plan)
        if fit.ok or observed.service is not None:
            _child("Service", build_service(stage), observed.service, ("spec",), plan)
        _pdb(stage, desired, observed.pdb, plan)
        if spec.network_policy.enabled and (fit.ok or observed.network_policy is not None):
            _child("NetworkPolicy", build_network_policy(stage), observed.network_policy, ("spec",), plan)
        elif not spec.network_policy.enabled and observed.network_policy is not None:
            plan.delete.append(Delete("NetworkPolicy", network_policy_name(stage), "NetworkPolicyDisabled"))
        _inference_pool(stage, fit.ok, observed.inference_pool, plan)
        plan.create.extend(build_pod(template, i, desired_hash, observed.image_volumes) for i in decisions.create)
        plan.patch.extend(Patch("Pod", name, FENCE) for name in rs.fence)
        plan.delete.extend(Delete("Pod", name, "Restart") for _, name in rs.recreate)
        plan.create.extend(build_pod(template, i, desired_hash, observed.image_volumes) for i, _ in rs.recreate)
        events += rs.events + target.events
    status = report.build_status(stage, pods, fit, decisions, desired_hash, observed.now, extras)
    if spec is not None:
        events += _lora_sync(stage, observed, status)
        if stage.wants_inference_pool and (fit.ok or observed.inference_pool is not None):
            status["inferencePool"] = inference_pool_name(stage)
    events = _decisions_explained(stage, plan, status) + events
    if observed.abort is not None:
        events.append(_abort_event(observed.abort))
    return Plan(plan.create, plan.patch, plan.delete,
                merge_patch(stage.status, status) if status != dict(stage.status) else None,
                [build_event(stage, *e, observed.now) for e in events], requeue)


def _lora_sync(stage: Stage, observed: Observed, status: dict[str, Any]) -> list[tuple[str, str, str]]:
    """status.loraSync (kept as it was unless a sync just ran) and the Events of what the sync did."""
    before = stage.status.get("loraSync")
    synced = observed.lora_sync
    record = synced.wire() if synced is not None else before
    if record is None and stage.spec.loras:
        record = {"applied": list(lora_sync.wanted(stage.spec.loras)), "errors": []}
    if record is None:
        return []
    status["loraSync"] = record
    if synced is None:
        return []
    out = [("Normal", "LorasSynced", "; ".join(synced.calls))] if synced.calls else []
    if synced.errors and list(synced.errors) != list((before or {}).get("errors") or ()):
        out.append(("Warning", "LoraSyncFailed", "; ".join(synced.errors)))
    return out


def _inference_pool(stage: Stage, fits: bool, observed: Any, plan: Plan) -> None:
    """spec.routing.inferencePool: the pool over the serving selector (created once the stage fits, like the
    Service); without it, the pool the operator made before (status.inferencePool) is deleted."""
    if stage.wants_inference_pool:
        if fits or observed is not None:
            _child("InferencePool", build_inference_pool(stage), observed, ("spec",), plan)
    elif stage.status.get("inferencePool"):
        plan.delete.append(Delete("InferencePool", inference_pool_name(stage), "RoutingRemoved"))


def _pdb(stage: Stage, replicas: int, observed: Any, plan: Plan) -> None:
    desired = build_pdb(stage, replicas)
    if desired is not None:
        _child("PodDisruptionBudget", desired, observed, ("spec",), plan)
    elif observed is not None:
        plan.delete.append(Delete("PodDisruptionBudget", pdb_name(stage), "NotNeeded"))


def _deleting(stage: Stage, observed: Observed, pods: dict[int, PodView], now: float) -> Plan:
    """The stage is being deleted: every pod leaves through the drain; the plan says how long to wait. The
    status says Terminating and is written only when that starts and when a pod leaves."""
    timeout = stage.spec.autoscaling.drain_timeout_seconds if stage.spec is not None else 0
    out = drain.Drains()
    live = [p for p in pods.values() if not p.terminating]
    drain.retire((p for p in live if p.draining_since is None), observed.health, "StageDeleted", now, timeout, out)
    drain.finish((p for p in live if p.draining_since is not None), observed.health, timeout, now, out)
    plan = Plan(patch=[Patch("Pod", n, b) for n, b in out.patch], delete=[Delete("Pod", n, w) for n, w in out.delete])
    status = report.build_deleting_status(stage, pods, {n for n, _ in out.delete}, {n for n, _ in out.patch},
                                          observed.now)
    events = _decisions_explained(stage, plan, None) + out.events
    return Plan(plan.create, plan.patch, plan.delete,
                merge_patch(stage.status, status) if status != dict(stage.status) else None,
                [build_event(stage, *e, observed.now) for e in events], out.requeue_after)


def _abort_event(result: dict[str, Any]) -> tuple[str, str, str]:
    aborted, unreachable = result.get("aborted") or [], result.get("unreachable") or []
    message = (f"abort {result['observedId']}: aborted {len(aborted)} request(s)"
               + (f" {', '.join(aborted)}" if aborted else "")
               + (f"; not found {', '.join(result['notFound'])}" if result.get("notFound") else "")
               + (f"; unreachable {'; '.join(unreachable)}" if unreachable else ""))
    return ("Warning" if unreachable else "Normal", "Aborted", message)


_BAD = {"Accepted": "False", "Degraded": "True", "Stalled": "True", "Compiled": "False"}
_CHOSEN = {"AutoChoseEager"}  # a bad status that was chosen, not suffered: no Warning Event


def _decisions_explained(stage: Stage, plan: Plan, status: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    """(type, reason, message) per decision: what was created or deleted, and conditions that turned bad."""
    out = []
    if pods := [o["metadata"]["name"] for o in plan.create if o["kind"] == "Pod"]:
        out.append(("Normal", "CreatedPods", f"created {', '.join(pods)}"))
    if gone := [d for d in plan.delete if d.kind == "Pod"]:
        out.append(("Normal", "DeletedPods", "deleted " + ", ".join(f"{d.name} ({d.reason})" for d in gone)))
    if status is None:
        return out
    before = {c.get("type"): (c.get("status"), c.get("reason")) for c in stage.status.get("conditions") or ()}
    for cond in status["conditions"]:
        bad = _BAD.get(cond["type"]) == cond["status"] and cond["reason"] not in _CHOSEN
        if bad and before.get(cond["type"]) != (cond["status"], cond["reason"]):
            out.append(("Warning", cond["reason"], cond["message"]))
    return out + _startup_explained(stage, status)


_WORDS = {"fetching": "fetching", "copyingModel": "copying the model", "buildingModel": "building the model",
          "loadingWeights": "loading weights", "warmup": "warmup"}


def _startup_explained(stage: Stage, status: dict[str, Any]) -> list[tuple[str, str, str]]:
    """A replica entering a startup phase (Fetching … Warmup), and once ready how long each phase took."""
    before = {(r["index"], r["pod"]): r for r in stage.status.get("replicaStatuses") or ()}
    out = []
    for r in status["replicaStatuses"]:
        old = before.get((r["index"], r["pod"]))
        if old is None:  # first seen now: the next change is news
            continue
        if r["phase"] in report.STARTUP_PHASES and old.get("phase") != r["phase"]:
            out.append(("Normal", "ReplicaStarting", f"{r['pod']}: {r['phase']}"))
        if r.get("ready") and not old.get("ready"):
            took = r.get("startupSeconds") or {}
            detail = ", ".join(f"{_WORDS.get(k, k)} {v:.1f} s" for k, v in took.items())
            out.append(("Normal", "ReplicaReady", f"{r['pod']} ready" + (f" after {detail}" if detail else "")))
    return out
