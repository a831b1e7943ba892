"""GPU capacity under Dynamic Resource Allocation (resource.k8s.io/v1), pure: when the stage's pods claim devices
(`podTemplate.resourceClaims`), how many of them one node can give, counted from the drivers' ResourceSlices.

- What a pod asks: each claim's ResourceClaimTemplate (or shared ResourceClaim) lists device requests; a request
  `exactly` (or its first `firstAvailable` alternative) names a DeviceClass and a `count` (default 1;
  `allocationMode: All` asks for at least one). Per pod: devices per DeviceClass, summed over the claims.
- What a node has: the devices of the node-local ResourceSlices (`spec.nodeName`) of the newest generation of each
  driver's pool, whose driver the DeviceClass selects. A class's selectors are CEL; the driver is read from its
  `device.driver == "..."` term (a class without one selects every driver's devices); other terms (attributes,
  capacity) are not evaluated, so the count is an upper bound — as `node.status.allocatable` is for extended
  resources: devices, not free devices.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

DRIVER_TERM = re.compile(r"""device\.driver\s*==\s*["']([^"']+)["']""")
RECHECK_SECONDS = 10.0  # ResourceSlices are not watched: a refusal looks again this often


@dataclass(frozen=True)
class Inventory:
    """What the operator read for the capacity check (`kube.read_dra`)."""

    claims: Mapping[str, Mapping[str, Any] | None] = field(default_factory=dict)  # resourceClaims entry → its object
    classes: Sequence[Mapping[str, Any]] = ()  # DeviceClasses
    slices: Sequence[Mapping[str, Any]] = ()  # ResourceSlices


def claim_source(entry: Mapping[str, Any]) -> tuple[str, str] | None:
    """(kind, name) a pod resourceClaims entry refers to: ResourceClaimTemplate or ResourceClaim."""
    if entry.get("resourceClaimTemplateName"):
        return "ResourceClaimTemplate", str(entry["resourceClaimTemplateName"])
    if entry.get("resourceClaimName"):
        return "ResourceClaim", str(entry["resourceClaimName"])
    return None


def _requests(obj: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    spec = obj.get("spec") or {}
    if obj.get("kind") == "ResourceClaimTemplate" or "spec" in spec:   # a template wraps the claim's spec
        spec = spec.get("spec") or {}
    return list((spec.get("devices") or {}).get("requests") or ())


def requested(entries: Iterable[Mapping[str, Any]], inventory: Inventory) -> tuple[Counter[str], list[str]]:
    """(devices per DeviceClass one pod asks for, problems: claims whose object is missing)."""
    need: Counter[str] = Counter()
    missing = []
    for entry in entries:
        source = claim_source(entry)
        if source is None:
            continue
        obj = inventory.claims.get(entry.get("name", ""))
        if obj is None:
            missing.append(f"{source[0]} {source[1]} (resourceClaims {entry.get('name')}) not found")
            continue
        for request in _requests(obj):
            exact = request.get("exactly") or (request.get("firstAvailable") or [{}])[0]
            if not exact.get("deviceClassName"):
                continue
            count = 1 if exact.get("allocationMode") == "All" else int(exact.get("count") or 1)
            need[str(exact["deviceClassName"])] += count
    return need, missing


def class_drivers(device_class: Mapping[str, Any]) -> set[str] | None:
    """The drivers a DeviceClass's selectors name (None: no driver term, every driver's devices count)."""
    drivers = {m for s in (device_class.get("spec") or {}).get("selectors") or ()
               for m in DRIVER_TERM.findall(str((s.get("cel") or {}).get("expression") or ""))}
    return drivers or None


def devices_per_node(slices: Iterable[Mapping[str, Any]], drivers: set[str] | None) -> dict[str, int]:
    """Node → devices of the node-local slices of those drivers, newest pool generation only."""
    slices = [s.get("spec") or {} for s in slices]
    newest: dict[tuple[str, str], int] = defaultdict(int)
    for s in slices:
        pool = s.get("pool") or {}
        key = (str(s.get("driver")), str(pool.get("name")))
        newest[key] = max(newest[key], int(pool.get("generation") or 0))
    out: Counter[str] = Counter()
    for s in slices:
        pool = s.get("pool") or {}
        if not s.get("nodeName") or (drivers is not None and s.get("driver") not in drivers):
            continue
        if int(pool.get("generation") or 0) == newest[(str(s.get("driver")), str(pool.get("name")))]:
            out[str(s["nodeName"])] += len(s.get("devices") or ())
    return dict(out)


def fit(entries: Sequence[Mapping[str, Any]], inventory: Inventory, nodes: Sequence[str]) -> tuple[bool, str]:
    """Whether one of `nodes` (the schedulable ones) has every device a pod claims; else why, with the numbers."""
    need, missing = requested(entries, inventory)
    if missing:
        return False, "; ".join(missing)
    if not need:
        return True, ""
    classes = {c["metadata"]["name"]: c for c in inventory.classes}
    counts: dict[str, dict[str, int]] = {}
    for name in need:
        if name not in classes:
            return False, f"DeviceClass {name} (named by the pod's resourceClaims) not found"
        counts[name] = devices_per_node(inventory.slices, class_drivers(classes[name]))
    if any(all(counts[c].get(node, 0) >= n for c, n in need.items()) for node in nodes):
        return True, ""
    parts = []
    for name, n in sorted(need.items()):
        drivers = class_drivers(classes[name])
        label = f"DeviceClass {name}" + (f" (driver {', '.join(sorted(drivers))})" if drivers else "")
        best = max(((counts[name].get(node, 0), node) for node in nodes), default=(0, None))
        where = f"the most on one schedulable node is {best[1]} with {best[0]}" if best[1] else "no schedulable node"
        parts.append(f"{n} device(s) of {label} in ResourceSlices: {where}")
    return False, "; ".join(parts)
