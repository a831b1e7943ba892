"""A Plan: the writes one reconcile decided, applied in order by `kube.apply` (the module that talks to the API)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Patch:
    kind: str  # "ConfigMap" | "Service" | "Pod" (fence: the serving label, the draining annotation)
    name: str
    body: dict[str, Any]  # a JSON merge patch


@dataclass(frozen=True)
class Delete:
    kind: str  # "Pod"
    name: str
    reason: str


@dataclass(frozen=True)
class Plan:
    """Deletes go first (a restarted replica's failed pod before its replacement of the same name), then
    creates (ConfigMap before the pods that mount it), patches, one status patch, and the Events that
    explain them."""

    create: list[dict[str, Any]] = field(default_factory=list)
    patch: list[Patch] = field(default_factory=list)
    delete: list[Delete] = field(default_factory=list)
    status: dict[str, Any] | None = None  # merge patch of .status; None: nothing changed
    events: list[dict[str, Any]] = field(default_factory=list)  # posted last, only when something happened
    requeue_after: float | None = None  # seconds until a deadline (backoff, drain) needs another look; no write

    @property
    def writes(self) -> int:
        return len(self.create) + len(self.patch) + len(self.delete) + (self.status is not None) + len(self.events)

    def summary(self) -> str:
        created = ", ".join(f"{o['kind']}/{o['metadata']['name']}" for o in self.create)
        patched = ", ".join(f"{p.kind}/{p.name}" for p in self.patch)
        deleted = ", ".join(f"{d.kind}/{d.name} ({d.reason})" for d in self.delete)
        parts = [f"create {created}" if created else "", f"patch {patched}" if patched else "",
                 f"delete {deleted}" if deleted else "", "status" if self.status is not None else ""]
        return "; ".join(p for p in parts if p) or "nothing to do"


def merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The RFC 7386 merge patch that turns `old` into `new` (removed keys become null; lists are replaced)."""
    patch: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            if sub := merge_patch(before, value):
                patch[key] = sub
        elif key not in old or value != before:
            patch[key] = value
    return patch


def contains(observed: Any, desired: Any) -> bool:
    """True when every field the operator sets (desired) has that value in the observed object; fields the
    API server added (clusterIP, defaults) are ignored."""
    if isinstance(desired, Mapping):
        return isinstance(observed, Mapping) and all(contains(observed.get(k), v) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(observed, list) and len(observed) == len(desired) and all(
            contains(o, d) for o, d in zip(observed, desired, strict=True))
    return observed == desired
