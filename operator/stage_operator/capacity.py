"""Can any schedulable node hold one pod's GPUs? (Topology arithmetic is CEL's and the runtime's job.) Two sources:
the node's allocatable extended resource (`gpuResourceName`, a device plugin) and, when the pods claim devices
(`podTemplate.resourceClaims`), the devices the drivers publish in ResourceSlices (`dra.py`): a node that fits
either way fits; a refusal names both, with the numbers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stage_operator import dra
from stage_operator.api.spec import Resources


@dataclass(frozen=True)
class Fit:
    """Whether new pods may be created; when not, the Accepted=False reason and what Progressing waits for."""

    ok: bool
    message: str = ""
    reason: str = "InsufficientGPUCapacity"
    waiting: str = "waiting for a node that fits"
    recheck: float | None = None  # seconds until another look (what is not watched: ResourceSlices)


def _quantity(value: Any) -> int:
    """Extended resources are whole numbers ("8"); anything else counts as zero."""
    try:
        return int(str(value))
    except ValueError:
        return 0


def node_summary(node: Mapping[str, Any], resource: str) -> tuple[str, int, bool]:
    """(name, allocatable count of `resource`, schedulable)."""
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    return (node["metadata"]["name"], _quantity(allocatable.get(resource, 0)),
            not (node.get("spec") or {}).get("unschedulable", False))


def check(resources: Resources, nodes: Sequence[Mapping[str, Any]] | None,
          claims: Sequence[Mapping[str, Any]] = (), inventory: dra.Inventory | None = None) -> Fit:
    """Fit(ok=True) when CPU ranks without device claims, when nodes were not looked at, or when some schedulable
    node fits: `gpusPerPod` of `gpuResourceName` allocatable, or (with `claims` and their `inventory`) every device
    the claims ask for in its ResourceSlices."""
    name, need = resources.gpu_resource_name, resources.gpus_per_pod
    claimed = bool(claims) and inventory is not None
    if (not name and not claimed) or nodes is None:
        return Fit(True)
    summaries = [node_summary(n, name) for n in nodes] if name else [(n["metadata"]["name"], 0, not (
        n.get("spec") or {}).get("unschedulable", False)) for n in nodes]
    schedulable = [(count, node) for node, count, ok in summaries if ok]
    if name and any(count >= need for count, _ in schedulable):
        return Fit(True)
    devices, why = dra.fit(claims, inventory, [node for _, node in schedulable]) if claimed else (False, "")
    if devices:
        return Fit(True)
    request = f"gpusPerPod={need} of {name}" if name else "the pod's resourceClaims"
    if not summaries:
        return Fit(False, f"{request} cannot be placed: the cluster has no nodes", recheck=_recheck(claimed))
    if not schedulable:
        return Fit(False, f"{request} cannot be placed: no node is schedulable", recheck=_recheck(claimed))
    parts = []
    if name:
        count, node = max(schedulable, key=lambda c: (c[0], c[1]))
        parts.append(f"{request} fits no schedulable node: the largest is {node} with {count} allocatable")
    if claimed:
        parts.append(f"nor the pod's resourceClaims: {why}" if name
                     else f"the pod's resourceClaims fit no schedulable node: {why}")
    return Fit(False, "; ".join(parts), recheck=_recheck(claimed))


def _recheck(claimed: bool) -> float | None:
    return dra.RECHECK_SECONDS if claimed else None
