"""The rollout through the drain (pure): `rollout.members_wanted` + `scaledown.plan` + `rollout.decide` walked
step by step the way reconciles see the world, for the `spec.rollout` knobs (maxSurge, maxUnavailable)."""
from __future__ import annotations

import dataclasses

import pytest

from stage_operator import rollout, scaledown
from stage_operator.api.spec import Rollout
from stage_operator.health import PodHealth
from stage_operator.observed import PodView

OLD, NEW, NOW = 'old', 'new', 1000.0


def view(index: int, pod_hash: str = OLD, ready: bool = True, **kw) -> PodView:
    return PodView(name=f's-{index}', index=index, phase=kw.pop('phase', 'Running'), ready=ready,
                   template_hash=pod_hash, terminating=False, unschedulable=None, failure=None, restarts=0,
                   uid=f'u{index}', pod_ip=kw.pop('pod_ip', '127.100.0.9'), **kw)


def step(pods: dict[int, PodView], policy: Rollout, desired: int, health=None, allow_surge: bool = True):
    """One reconcile's pod decisions: (indices created, pods fenced, pods deleted)."""
    health = health or {}
    count = rollout.members_wanted(desired, pods, NEW, policy, allow_surge=allow_surge)
    scaled = scaledown.plan(count, pods, health, 60, NOW, NEW)
    out = rollout.decide(scaled.members, scaled.kept, NEW, allow_create=True, policy=policy, desired=desired,
                         health=health, now=NOW)
    fenced = [n for n, _ in scaled.patch + out.drains.patch]
    return out.create, fenced, [n for n, _ in scaled.delete + out.drains.delete]


def walk(policy: Rollout, desired: int = 3) -> list[tuple[int, int, int]]:
    """Roll 3 old pods to NEW, playing the kubelet (a created pod turns ready next round) and the stage (a
    fenced pod reports idle and is deleted): (live pods, ready pods, old pods) after each round."""
    pods = {i: view(i) for i in range(desired)}
    trace = []
    for _ in range(30):
        idle = {p.uid: PodHealth('Healthy', NOW, answered=True, waiting=0, running=0) for p in pods.values()
                if p.draining_since is not None}  # a probe after the fence: nothing in flight
        created, fenced, deleted = step(pods, policy, desired, idle)
        for name in deleted:
            pods = {i: p for i, p in pods.items() if p.name != name}
        for i, p in list(pods.items()):
            if p.name in fenced:
                pods[i] = dataclasses.replace(p, serving=False, draining_since=NOW - 1, drain_reason='Outdated')
            elif p.template_hash == NEW and not p.ready:
                pods[i] = dataclasses.replace(p, ready=True)
        for i in created:
            pods[i] = view(i, NEW, ready=False)
        live_ready = sum(1 for p in pods.values() if p.ready and p.draining_since is None)
        trace.append((len(pods), live_ready, sum(1 for p in pods.values() if p.template_hash == OLD)))
        if all(p.template_hash == NEW and p.ready for p in pods.values()) and len(pods) == desired:
            return trace
    raise AssertionError(f'the rollout did not finish: {trace}')


@pytest.mark.parametrize('surge, unavailable', [(0, 1), (1, 0), (1, 1), (2, 0), (0, 3)])
def test_every_rollout_finishes_within_its_surge_and_unavailability(surge, unavailable):
    trace = walk(Rollout(max_surge=surge, max_unavailable=unavailable))
    assert max(live for live, _, _ in trace) <= 3 + surge, trace  # GPUs: never more than replicas + maxSurge
    assert min(ready for _, ready, _ in trace) >= 3 - unavailable, trace  # serving: never below the floor
    assert trace[-1] == (3, 3, 0)


def test_max_surge_creates_the_new_pod_before_any_old_one_leaves():
    pods = {i: view(i) for i in range(3)}
    created, fenced, deleted = step(pods, Rollout(max_surge=1, max_unavailable=0), 3)
    assert created == [3] and fenced == [] and deleted == []
    pods[3] = view(3, NEW, ready=False)
    assert step(pods, Rollout(max_surge=1, max_unavailable=0), 3) == ([], [], []), 'wait for it to be ready'


def test_no_surge_without_capacity():
    pods = {i: view(i) for i in range(3)}
    created, fenced, _ = step(pods, Rollout(max_surge=1, max_unavailable=1), 3, allow_surge=False)
    assert created == [] and fenced == ['s-0']


def test_the_least_loaded_outdated_pod_leaves_first():
    pods = {i: view(i) for i in range(3)}
    health = {f'u{i}': PodHealth('Healthy', NOW, answered=True, waiting=0, running=n) for i, n in enumerate((3, 2, 0))}
    assert step(pods, Rollout(), 3, health)[1] == ['s-2']


def test_an_outdated_pod_with_no_work_is_deleted_at_once():
    pods = {0: view(0, phase='Failed', ready=False), 1: view(1), 2: view(2)}
    created, fenced, deleted = step(pods, Rollout(max_unavailable=1), 3)
    assert deleted == ['s-0'] and fenced == []  # not serving anyway: costs no availability, needs no drain


def test_scale_down_picks_idle_then_outdated_then_least_loaded():
    pods = {0: view(0, NEW), 1: view(1, NEW), 2: view(2, OLD), 3: view(3, NEW)}
    health = {'u0': PodHealth('Healthy', NOW, answered=True, waiting=0, running=2),
              'u1': PodHealth('Healthy', NOW, answered=True, waiting=0, running=0),
              'u2': PodHealth('Healthy', NOW, answered=True, waiting=0, running=5),
              'u3': PodHealth('Healthy', NOW, answered=True, waiting=1, running=1)}
    out = scaledown.plan(2, pods, health, 60, NOW, NEW)
    assert [n for n, _ in out.patch] == ['s-2', 's-1'] and out.members == [0, 3]


def test_a_pod_without_a_pod_ip_has_no_work_and_goes_at_once():
    pods = {i: view(i, pod_ip=None) for i in range(3)}  # nothing, not even the Service, can reach it
    assert step(pods, Rollout(), 3) == ([], [], ['s-0'])
