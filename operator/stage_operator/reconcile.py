"""`reconcile(stage, observed) -> Plan`: level-based and pure. Nothing changed → an empty plan (zero writes).

Steps: parse (done: `Stage`) → capacity (`capacity.check`) → which replicas exist (`spec.replicas`, or under
operator autoscaling `autoscale.decide`; then `scaledown.plan`, which fences and drains removed replicas) → pod
decisions (`rollout.decide`) → the restart policy on failed pods (`restarts.decide`: fence, backoff,
recreate or Stalled) → children (ConfigMap, Service) → status (`report.build_status`, with the probe
results and the abort outcome the controller observed) → Events for what changed. One writer: the plan.
"""

from __future__ import annotations

from typing import Any

from stage_operator import autoscale, capacity, report, restarts, rollout, scaledown
from stage_operator.api.meta import LABEL_SERVING
from stage_operator.builders.children import build_configmap, build_service
from stage_operator.builders.event import build_event
from stage_operator.builders.pod import build_pod, template_hash
from stage_operator.observed import Observed
from stage_operator.plan import Delete, Patch, Plan, contains, merge_patch
from stage_operator.stage import Stage

FENCE = {"metadata": {"labels": {LABEL_SERVING: "false"}}}


def needs_nodes(stage: Stage, observed: Observed) -> bool:
    """Whether the capacity check needs the node list: GPUs requested and replicas to create or a failed check."""
    if stage.spec is None or stage.deleting or not stage.spec.resources.gpu_resource_name:
        return False
    pods = observed.pod_views()
    replicas = stage.spec.replicas
    if stage.spec.autoscaling.mode == "Operator":  # the operator's own decision, not spec.replicas
        replicas = int((stage.status.get("autoscaling") or {}).get("desiredReplicas", replicas))
    missing = len([p for p in pods.values() if not p.terminating]) < replicas
    accepted = next((c for c in stage.status.get("conditions") or () if c.get("type") == "Accepted"), None)
    return missing or bool(accepted and accepted.get("status") == "False")


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
    if stage.deleting:  # the children carry ownerReferences: garbage collection removes them
        return plan
    pods, now = observed.pod_views(), observed.epoch
    spec, desired_hash = stage.spec, None
    fit = capacity.Fit(True)
    decisions = rollout.Decisions()
    extras = report.Extras(abort=observed.abort)
    events: list[tuple[str, str, str]] = []
    requeue = None
    if spec is not None:
        desired_hash = template_hash(stage, observed.image_volumes)
        fit = capacity.check(spec.resources, observed.nodes)
        desired, autoscaling = spec.replicas, None
        if spec.autoscaling.mode == "Operator":  # the operator's own decision instead of spec.replicas
            desired, autoscaling, event = autoscale.decide(spec, stage.status.get("autoscaling"),
                                                           observed.load_samples, now)
            events += [event] if event else []
        # Every scale-down (kubectl scale, an HPA, the operator's autoscaler) fences and drains the removed
        # replicas before deleting them: no request is lost to it.
        scaled = scaledown.plan(desired, pods, observed.health, spec.autoscaling.drain_timeout_seconds, now)
        members, kept, requeue = scaled.members, scaled.kept, scaled.requeue_after
        plan.patch.extend(Patch("Pod", name, body) for name, body in scaled.patch)
        plan.delete.extend(Delete("Pod", name, why) for name, why in scaled.delete)
        events += scaled.events
        decisions = rollout.decide(members, kept, desired_hash, allow_create=fit.ok)
        rs = restarts.decide(spec.restart_policy, stage.status, stage.generation, kept, observed.health,
                             spec.health_check.failure_threshold, desired_hash, now)
        extras = report.Extras(members, rs, observed.health, observed.abort, autoscaling)
        requeue = _soonest(requeue, rs.requeue_after)
        if fit.ok or observed.configmap is not None:
            _child("ConfigMap", build_configmap(stage), observed.configmap, ("data",), plan)
        if fit.ok or observed.service is not None:
            _child("Service", build_service(stage), observed.service, ("spec",), plan)
        plan.create.extend(build_pod(stage, i, desired_hash, observed.image_volumes) for i in decisions.create)
        plan.delete.extend(Delete("Pod", name, decisions.reasons[name]) for name in decisions.delete)
        plan.patch.extend(Patch("Pod", name, FENCE) for name in rs.fence)
        plan.delete.extend(Delete("Pod", name, "Restart") for _, name in rs.recreate)
        plan.create.extend(build_pod(stage, i, desired_hash, observed.image_volumes) for i, _ in rs.recreate)
        events += rs.events
    status = report.build_status(stage, pods, fit, decisions, desired_hash, observed.now, extras)
    events = _decisions_explained(stage, plan, status) + events
    if observed.abort is not None:
        events.append(_abort_event(observed.abort))
    return Plan(plan.create, plan.patch, plan.delete,
                merge_patch(stage.status, status) if status != dict(stage.status) else None,
                [build_event(stage, *e, observed.now) for e in events], requeue)


def _abort_event(result: dict[str, Any]) -> tuple[str, str, str]:
    aborted, unreachable = result.get("aborted") or [], result.get("unreachable") or []
    message = (f"abort {result['observedId']}: aborted {len(aborted)} request(s)"
               + (f" {', '.join(aborted)}" if aborted else "")
               + (f"; not found {', '.join(result['notFound'])}" if result.get("notFound") else "")
               + (f"; unreachable {'; '.join(unreachable)}" if unreachable else ""))
    return ("Warning" if unreachable else "Normal", "Aborted", message)


_BAD = {"Accepted": "False", "Degraded": "True", "Stalled": "True"}


def _decisions_explained(stage: Stage, plan: Plan, status: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(type, reason, message) per decision: what was created or deleted, and conditions that turned bad."""
    out = []
    if pods := [o["metadata"]["name"] for o in plan.create if o["kind"] == "Pod"]:
        out.append(("Normal", "CreatedPods", f"created {', '.join(pods)}"))
    if plan.delete:
        out.append(("Normal", "DeletedPods", "deleted " + ", ".join(f"{d.name} ({d.reason})" for d in plan.delete)))
    before = {c.get("type"): (c.get("status"), c.get("reason")) for c in stage.status.get("conditions") or ()}
    for cond in status["conditions"]:
        bad = _BAD.get(cond["type"]) == cond["status"]
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
