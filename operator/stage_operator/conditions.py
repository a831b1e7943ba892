"""metav1-style conditions: lastTransitionTime moves only when a condition's status changes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from stage_operator.api.status import CONDITION_TYPES


def condition(kind: str, status: bool, reason: str, message: str) -> dict[str, Any]:
    return {"type": kind, "status": "True" if status else "False", "reason": reason, "message": message}


def merge(previous: Sequence[Mapping[str, Any]], new: Sequence[dict[str, Any]], generation: int,
          now: str) -> list[dict[str, Any]]:
    """The new conditions in CONDITION_TYPES order, each with observedGeneration and a transition time kept
    from the previous condition of the same type when its status did not change."""
    before = {c.get("type"): c for c in previous}
    out = []
    for cond in sorted(new, key=lambda c: CONDITION_TYPES.index(c["type"])):
        old = before.get(cond["type"])
        since = old.get("lastTransitionTime") if old and old.get("status") == cond["status"] else None
        out.append({**cond, "observedGeneration": generation, "lastTransitionTime": since or now})
    return out
