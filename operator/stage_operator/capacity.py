"""Can any schedulable node hold one pod's GPUs? (Topology arithmetic is CEL's and the runtime's job.)"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stage_operator.api.spec import Resources


@dataclass(frozen=True)
class Fit:
    """Whether new pods may be created; when not, the Accepted=False reason and what Progressing waits for."""

    ok: bool
    message: str = ""
    reason: str = "InsufficientGPUCapacity"
    waiting: str = "waiting for a node that fits"


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


def check(resources: Resources, nodes: Sequence[Mapping[str, Any]] | None) -> Fit:
    """Fit(ok=True) when CPU ranks, when nodes were not looked at, or when some schedulable node fits."""
    name, need = resources.gpu_resource_name, resources.gpus_per_pod
    if not name or nodes is None:
        return Fit(True)
    summaries = [node_summary(n, name) for n in nodes]
    schedulable = [(count, node) for node, count, ok in summaries if ok]
    if any(count >= need for count, _ in schedulable):
        return Fit(True)
    request = f"gpusPerPod={need} of {name}"
    if not summaries:
        return Fit(False, f"{request} cannot be placed: the cluster has no nodes")
    if not schedulable:
        return Fit(False, f"{request} cannot be placed: no node is schedulable")
    count, node = max(schedulable, key=lambda c: (c[0], c[1]))
    return Fit(False, f"{request} fits no schedulable node: the largest is {node} with {count} allocatable")
