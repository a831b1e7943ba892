"""Which replicas exist under operator autoscaling, and how a removed one leaves without losing a request
(pure): the least-loaded replicas are fenced (serving=false: out of the Service; annotated with the time),
kept while a probe taken after the fence still sees requests in flight (up to the drain timeout), and only
then deleted. Scaling back up first returns drained replicas to service; new replicas take the lowest free
indices."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stage_operator.api.meta import ANNOTATION_DRAINING, LABEL_SERVING
from stage_operator.clock import format_time
from stage_operator.health import PodHealth
from stage_operator.observed import PodView


@dataclass
class Members:
    members: list[int] = field(default_factory=list)  # the indices that should exist
    kept: dict[int, PodView] = field(default_factory=dict)  # the pods the rollout and restarts look after
    patch: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (pod, merge patch): fence, return
    delete: list[tuple[str, str]] = field(default_factory=list)  # (pod, reason)
    events: list[tuple[str, str, str]] = field(default_factory=list)
    requeue_after: float | None = None


def _load(pod: PodView, health: PodHealth | None) -> tuple[int, int, int]:
    """Sort key, cheapest to remove first: not serving work at all, then fewest in flight, then highest index."""
    in_flight = health.in_flight if health is not None and health.in_flight is not None else None
    idle = not pod.running or pod.failure is not None
    return (0 if idle else 1, in_flight if in_flight is not None else 1 << 30, -pod.index)


def fence(now: float) -> dict[str, Any]:
    return {"metadata": {"labels": {LABEL_SERVING: "false"},
                         "annotations": {ANNOTATION_DRAINING: format_time(now, millis=True)}}}


UNFENCE = {"metadata": {"labels": {LABEL_SERVING: "true"}, "annotations": {ANNOTATION_DRAINING: None}}}


def plan(desired: int, pods: Mapping[int, PodView], health: Mapping[str, PodHealth], drain_timeout: float,
         now: float) -> Members:
    out = Members()
    live = {i: p for i, p in pods.items() if not p.terminating}
    draining = {i: p for i, p in live.items() if p.draining_since is not None}
    active = {i: p for i, p in live.items() if i not in draining}
    excess = len(active) - desired
    if excess > 0:
        for pod in sorted(active.values(), key=lambda p: _load(p, health.get(p.uid)))[:excess]:
            del active[pod.index]
            h = health.get(pod.uid)
            if not pod.running or pod.failure is not None:
                out.delete.append((pod.name, "ScaleDown"))  # no work on it: nothing to wait for
            else:
                out.patch.append((pod.name, fence(now)))
                load = f" with {h.in_flight} in flight" if h is not None and h.in_flight is not None else ""
                out.events.append(("Normal", "DrainingReplica",
                                   f"fenced {pod.name}{load} for a scale-down to {desired}; deleted once idle "
                                   f"(at most {drain_timeout:g}s)"))
    elif excess < 0 and draining:
        busiest = sorted(draining.values(), key=lambda p: _load(p, health.get(p.uid)), reverse=True)
        for pod in busiest[:-excess]:
            del draining[pod.index]
            active[pod.index] = pod
            out.patch.append((pod.name, UNFENCE))
            out.events.append(("Normal", "UndrainedReplica", f"{pod.name} serves again (scaled back up)"))
    for pod in draining.values():
        h = health.get(pod.uid)
        idle = h is not None and h.checked_at > pod.draining_since and h.in_flight == 0
        deadline = pod.draining_since + drain_timeout
        if not pod.running or idle or (h is not None and h.health == "Unhealthy"):  # a dead engine serves nobody
            out.delete.append((pod.name, "ScaleDown"))
        elif now >= deadline:
            out.delete.append((pod.name, "DrainTimeout"))
        else:
            wait = deadline - now
            out.requeue_after = wait if out.requeue_after is None else min(out.requeue_after, wait)
    out.kept = {i: p for i, p in pods.items() if i in active or p.terminating}
    taken = set(live)             # a terminating pod's index is reused once it is gone (the rollout waits)
    free = (i for i in range(len(pods) + desired + 1) if i not in taken)
    out.members = sorted([*active, *(next(free) for _ in range(max(0, desired - len(active))))])
    return out
