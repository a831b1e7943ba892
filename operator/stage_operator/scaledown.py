"""Which replicas exist, and how removed ones leave without losing a request (pure): the least-loaded
replicas go (idle or failed first, then outdated ones, then fewest in flight, then the highest index), through
the one drain (`drain.py`): fenced, kept while a probe taken after the fence still sees requests in flight (up
to the drain timeout), and only then deleted. Scaling back up first returns drained replicas of the current
revision to service; new replicas take the lowest free indices."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from stage_operator import drain
from stage_operator.drain import UNFENCE, fence  # noqa: F401 (fence: re-exported for the tests)
from stage_operator.health import PodHealth
from stage_operator.observed import PodView


@dataclass
class Members(drain.Drains):
    members: list[int] = field(default_factory=list)  # the indices that should exist
    kept: dict[int, PodView] = field(default_factory=dict)  # the pods the rollout and restarts look after


def victim_order(pod: PodView, health: PodHealth | None, desired_hash: str | None) -> tuple[int, int, int, int]:
    idle, in_flight = drain.load(pod, health)
    outdated = desired_hash is not None and pod.template_hash != desired_hash
    return (idle, 0 if outdated else 1, in_flight, -pod.index)


def plan(desired: int, pods: Mapping[int, PodView], health: Mapping[str, PodHealth], drain_timeout: float,
         now: float, desired_hash: str | None = None) -> Members:
    out = Members()
    live = {i: p for i, p in pods.items() if not p.terminating}
    draining = {i: p for i, p in live.items() if p.draining_since is not None}
    active = {i: p for i, p in live.items() if i not in draining}
    excess = len(active) - desired
    if excess > 0:
        victims = sorted(active.values(), key=lambda p: victim_order(p, health.get(p.uid), desired_hash))[:excess]
        for pod in victims:
            del active[pod.index]
        drain.retire(victims, health, "ScaleDown", now, drain_timeout, out, f" to {desired}")
    elif excess < 0 and draining:
        returnable = [p for p in draining.values() if desired_hash is None or p.template_hash == desired_hash]
        busiest = sorted(returnable, key=lambda p: drain.load(p, health.get(p.uid)), reverse=True)
        for pod in busiest[:-excess]:
            del draining[pod.index]
            active[pod.index] = pod
            out.patch.append((pod.name, UNFENCE))
            out.events.append(("Normal", "UndrainedReplica", f"{pod.name} serves again (scaled back up)"))
    drain.finish(draining.values(), health, drain_timeout, now, out)
    out.kept = {i: p for i, p in pods.items() if i in active or p.terminating}
    taken = set(live)             # a terminating pod's index is reused once it is gone (the rollout waits)
    free = (i for i in range(len(pods) + desired + 1) if i not in taken)
    out.members = sorted([*active, *(next(free) for _ in range(max(0, desired - len(active))))])
    return out
