"""The one way a serving pod leaves (pure), whatever removes it: a rollout, a scale-down in any autoscaling
mode, a spec change, the stage's deletion. No request is lost to it:

1. **retire**: a pod with no work (not running, failed, or without a pod IP) is deleted at once; a running one is fenced
   (label serving=false: out of the Service at once; annotations `draining-since` and `drain-reason`);
2. **finish**: a fenced pod is deleted once a probe taken after the fence sees nothing in flight but its video jobs
   (deleted, the stage checkpoints each, releases its lease and another replica resumes it: a long video never
   holds a drain), or it turns unhealthy (a dead engine serves nobody), or `drainTimeoutSeconds` pass (reason
   DrainTimeout).

The pod's own `preStop` and `terminationGracePeriodSeconds` (builders/pod.py) cover what the operator does not
start: an eviction or a `kubectl delete pod` still lets the stage finish what it holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from stage_operator.api.meta import ANNOTATION_DRAIN_REASON, ANNOTATION_DRAINING, LABEL_SERVING
from stage_operator.clock import format_time
from stage_operator.health import PodHealth
from stage_operator.observed import PodView

WHY = {"ScaleDown": "a scale-down", "Outdated": "a rollout", "StageDeleted": "the stage's deletion"}


def fence(now: float, reason: str = "ScaleDown") -> dict[str, Any]:
    return {"metadata": {"labels": {LABEL_SERVING: "false"},
                         "annotations": {ANNOTATION_DRAINING: format_time(now, millis=True),
                                         ANNOTATION_DRAIN_REASON: reason}}}


UNFENCE = {"metadata": {"labels": {LABEL_SERVING: "true"},
                        "annotations": {ANNOTATION_DRAINING: None, ANNOTATION_DRAIN_REASON: None}}}


@dataclass
class Drains:
    patch: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (pod, merge patch): the fence
    delete: list[tuple[str, str]] = field(default_factory=list)  # (pod, reason)
    events: list[tuple[str, str, str]] = field(default_factory=list)
    requeue_after: float | None = None

    def wake(self, seconds: float) -> None:
        self.requeue_after = seconds if self.requeue_after is None else min(self.requeue_after, seconds)


def has_work(pod: PodView) -> bool:
    """Whether requests can be in flight on it: a running, not failed container at a pod IP (without an IP
    nothing, the Service included, can reach it)."""
    return pod.running and pod.failure is None and pod.endpoint is not None


def load(pod: PodView, health: PodHealth | None) -> tuple[int, int]:
    """Cheapest to remove first: not serving work at all, then fewest in flight (unknown counts as busy)."""
    idle = not has_work(pod)
    in_flight = health.in_flight if health is not None and health.in_flight is not None else None
    return (0 if idle else 1, in_flight if in_flight is not None else 1 << 30)


def retire(pods: Iterable[PodView], health: Mapping[str, PodHealth], reason: str, now: float, drain_timeout: float,
           out: Drains, detail: str = "") -> None:
    """Start the drain of each pod (not already draining or terminating)."""
    for pod in pods:
        if pod.terminating or pod.draining_since is not None:
            continue
        if not has_work(pod):
            out.delete.append((pod.name, reason))  # no work on it: nothing to wait for
            continue
        out.patch.append((pod.name, fence(now, reason)))
        h = health.get(pod.uid)
        busy = f" with {h.in_flight} in flight" if h is not None and h.in_flight is not None else ""
        if h is not None and h.jobs_here:
            busy += f" ({h.jobs_here} video job(s): handed off to another replica when it stops)"
        out.events.append(("Normal", "DrainingReplica",
                           f"fenced {pod.name}{busy} for {WHY.get(reason, reason)}{detail}; deleted once idle "
                           f"(at most {drain_timeout:g}s)"))
        out.wake(drain_timeout)


def finish(draining: Iterable[PodView], health: Mapping[str, PodHealth], drain_timeout: float, now: float,
           out: Drains) -> None:
    """Delete each fenced pod whose work is done (or whose time is up)."""
    for pod in draining:
        if pod.terminating:
            continue
        h = health.get(pod.uid)    # its video jobs do not hold it: stopped, it hands them to another replica
        idle = h is not None and h.checked_at > pod.draining_since and h.in_flight is not None \
            and h.in_flight <= h.jobs_here
        deadline = pod.draining_since + drain_timeout
        if not has_work(pod) or idle or (h is not None and h.health == "Unhealthy"):
            out.delete.append((pod.name, pod.drain_reason))
        elif now >= deadline:
            out.delete.append((pod.name, "DrainTimeout"))
        else:
            out.wake(deadline - now)
