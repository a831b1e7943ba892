"""`reconcile(stage, observed) -> Plan`: level-based and pure. Nothing changed → an empty plan (zero writes).

Steps: parse (done: `Stage`) → capacity (`capacity.check`) → pod decisions (`rollout.decide`) → children
(ConfigMap, Service) → status (`report.build_status`) → Events for what changed. Later behaviours plug in as
more pure steps between these, never as a second writer: the restart policy decides on Failed pods beside
`rollout.decide` (recreate after backoff, or Stalled) and counts `status.restarts`; abort and autoscaling
compute their own status fields, which `report` carries over until then.
"""

from __future__ import annotations

from typing import Any

from stage_operator import capacity, report, rollout
from stage_operator.builders.children import build_configmap, build_service
from stage_operator.builders.event import build_event
from stage_operator.builders.pod import build_pod, template_hash
from stage_operator.observed import Observed
from stage_operator.plan import Delete, Patch, Plan, contains, merge_patch
from stage_operator.stage import Stage


def needs_nodes(stage: Stage, observed: Observed) -> bool:
    """Whether the capacity check needs the node list: GPUs requested and replicas to create or a failed check."""
    if stage.spec is None or stage.deleting or not stage.spec.resources.gpu_resource_name:
        return False
    pods = observed.pod_views()
    missing = any(i not in pods for i in range(stage.spec.replicas))
    accepted = next((c for c in stage.status.get("conditions") or () if c.get("type") == "Accepted"), None)
    return missing or bool(accepted and accepted.get("status") == "False")


def _child(kind: str, desired: dict[str, Any], observed: Any, owned: tuple[str, ...], plan: Plan) -> None:
    if observed is None:
        plan.create.append(desired)
        return
    wanted = {"metadata": {"labels": desired["metadata"]["labels"]}, **{k: desired[k] for k in owned}}
    if not contains(observed, wanted):
        plan.patch.append(Patch(kind, desired["metadata"]["name"], wanted))


def reconcile(stage: Stage, observed: Observed) -> Plan:
    plan = Plan()
    if stage.deleting:  # the children carry ownerReferences: garbage collection removes them
        return plan
    pods = observed.pod_views()
    spec, desired_hash = stage.spec, None
    fit = capacity.Fit(True)
    decisions = rollout.Decisions()
    if spec is not None:
        desired_hash = template_hash(stage)
        fit = capacity.check(spec.resources, observed.nodes)
        decisions = rollout.decide(spec.replicas, pods, desired_hash, allow_create=fit.ok)
        if fit.ok or observed.configmap is not None:
            _child("ConfigMap", build_configmap(stage), observed.configmap, ("data",), plan)
        if fit.ok or observed.service is not None:
            _child("Service", build_service(stage), observed.service, ("spec",), plan)
        plan.create.extend(build_pod(stage, i, desired_hash) for i in decisions.create)
        plan.delete.extend(Delete("Pod", name, decisions.reasons[name]) for name in decisions.delete)
    status = report.build_status(stage, pods, fit, decisions, desired_hash, observed.now)
    events = [build_event(stage, *e, observed.now) for e in _decisions_explained(stage, plan, status)]
    return Plan(plan.create, plan.patch, plan.delete,
                merge_patch(stage.status, status) if status != dict(stage.status) else None, events)


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
    return out
