"""Which replicas to create and which outdated pods to retire (pure): a pod-template change rolls out within
`spec.rollout` — at most `maxUnavailable` replicas below `replicas`, at most `maxSurge` extra pods (only when
the GPU capacity check passes) — and every outdated pod leaves through the drain (`drain.py`: fenced, deleted
once idle), least-loaded first. Failed pods are only reported here; recreating them with backoff and a budget
is the restart policy's decision, and rolling back a failing revision is `rollback.py`'s."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from stage_operator import drain
from stage_operator.api.spec import Rollout
from stage_operator.health import PodHealth
from stage_operator.observed import PodView


@dataclass(frozen=True)
class Decisions:
    create: list[int] = field(default_factory=list)  # replica indices
    drains: drain.Drains = field(default_factory=drain.Drains)  # outdated pods fenced or deleted

    @property
    def delete(self) -> list[str]:
        return [name for name, _ in self.drains.delete]


def members_wanted(desired: int, pods: Mapping[int, PodView], desired_hash: str, policy: Rollout, *,
                   allow_surge: bool) -> int:
    """How many replica indices should exist: `desired`, plus the surge while outdated pods remain, less the
    outdated pods still draining (their GPUs are not free yet: a replacement waits for them)."""
    live = [p for p in pods.values() if not p.terminating]
    outdated = sum(1 for p in live if p.draining_since is None and p.template_hash != desired_hash)
    leaving = sum(1 for p in live if p.draining_since is not None and p.drain_reason == "Outdated")
    surge = min(policy.max_surge, outdated + leaving) if allow_surge else 0  # held until the last old pod is gone
    return max(0, desired + surge - leaving)


def decide(members: int | Sequence[int], pods: Mapping[int, PodView], desired_hash: str, *, allow_create: bool,
           policy: Rollout | None = None, desired: int | None = None, health: Mapping[str, PodHealth] | None = None,
           now: float = 0.0, drain_timeout: float = 60) -> Decisions:
    """`members`: the replica indices that should exist (a count means 0..n-1); `desired`: the replicas the
    stage should serve (members less the surge; default all members)."""
    members = range(members) if isinstance(members, int) else members
    policy, health = policy or Rollout(), health or {}
    desired = len(members) if desired is None else desired
    out = Decisions()
    if allow_create:
        out.create.extend(i for i in members if i not in pods)
    current = {i: pods[i] for i in members if i in pods and not pods[i].terminating}
    extra = [p for i, p in sorted(pods.items()) if i not in members and not p.terminating]
    drain.retire(extra, health, "ScaleDown", now, drain_timeout, out.drains)
    outdated = [p for p in current.values() if p.template_hash != desired_hash and p.draining_since is None]
    leaving = [p for p in outdated if not p.available]  # not serving anyway: replacing it costs no availability
    available = sum(1 for p in current.values() if p.available)
    floor = desired - policy.max_unavailable
    for pod in sorted((p for p in outdated if p.available), key=lambda p: (drain.load(p, health.get(p.uid)), p.index)):
        if available - 1 < floor:
            break
        leaving.append(pod)
        available -= 1
    drain.retire(leaving, health, "Outdated", now, drain_timeout, out.drains)
    return out
