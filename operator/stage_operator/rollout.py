"""Which replicas to create and which pods to delete: scale up and down, and roll a spec change one pod at a
time (maxUnavailable 1, no surge: GPUs are scarce). Failed pods are only reported here; recreating them
with backoff and a budget is the restart policy's decision, a later step beside this one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from stage_operator.observed import PodView

MAX_UNAVAILABLE = 1


@dataclass(frozen=True)
class Decisions:
    create: list[int] = field(default_factory=list)  # replica indices
    delete: list[str] = field(default_factory=list)  # pod names
    reasons: dict[str, str] = field(default_factory=dict)  # pod name -> why it goes (ScaleDown, Outdated)


def decide(members: int | Sequence[int], pods: dict[int, PodView], desired_hash: str, *,
           allow_create: bool) -> Decisions:
    """`members`: the replica indices that should exist (a count means 0..n-1)."""
    members = range(members) if isinstance(members, int) else members
    out = Decisions()
    for index, pod in sorted(pods.items()):
        if index not in members and not pod.terminating:
            out.delete.append(pod.name)
            out.reasons[pod.name] = "ScaleDown"
    if allow_create:
        out.create.extend(i for i in members if i not in pods)
    outdated = [pods[i] for i in members if i in pods and not pods[i].terminating
                and pods[i].template_hash != desired_hash]
    for pod in outdated:  # not serving anyway: replacing it costs no availability
        if not pod.available:
            out.delete.append(pod.name)
            out.reasons[pod.name] = "Outdated"
    unavailable = sum(1 for i in members if i not in pods or not pods[i].available)
    budget = MAX_UNAVAILABLE - unavailable
    for pod in (p for p in outdated if p.available):
        if budget <= 0:
            break
        out.delete.append(pod.name)
        out.reasons[pod.name] = "Outdated"
        budget -= 1
    return out
