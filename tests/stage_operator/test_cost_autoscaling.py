"""Operator autoscaling on cost (pure reconcile): on a mixed-resolution workload the stage scales on the work its
replicas hold (outstanding pixel-steps, each replica's /v1/stats cost), not on how many requests there are. A few
large requests scale out where `metric: inflight` does not; many small ones scale out on inflight and not on cost."""
from __future__ import annotations

import dataclasses

import pytest
from support.reconcile_world import CPU, pod, stage, world

from stage_operator.autoscale import demand
from stage_operator.clock import parse_time
from stage_operator.health import PodHealth
from stage_operator.reconcile import reconcile

BIG = 1024 * 1024 * 50          # one 1024x1024 50-step image, not started: its outstanding pixel-steps
SMALL = 256 * 256 * 20          # one 256x256 20-step image: 40x less work
TARGET_COST = 30_000_000        # about half a large image per replica


def autoscaled(metric: str) -> dict:
    target = {'metric': 'cost', 'targetCostPerReplica': TARGET_COST} if metric == 'cost' else {'metric': 'inflight'}
    return {**CPU, 'engine': {'maxNumSeqs': 4}, 'autoscaling': {
        'mode': 'Operator', 'minReplicas': 1, 'maxReplicas': 4, 'scaleUpStabilizationSeconds': 0,
        'scaleDownStabilizationSeconds': 0, **target}}


def probed(waiting: int, running: int, cost: int) -> PodHealth:
    return PodHealth('Healthy', 0.0, answered=True, state='ready', waiting=waiting, running=running, cost=cost)


# per replica: (waiting, running, outstanding pixel-steps)
FEW_LARGE = [(1, 1, 2 * BIG), (0, 1, SMALL)]                       # 3 requests in flight, ~106 M pixel-steps
MANY_SMALL = [(4, 4, 8 * SMALL), (4, 4, 8 * SMALL)]               # 16 requests in flight, ~21 M pixel-steps


@pytest.mark.parametrize('load, metric, replicas', [
    (FEW_LARGE, 'cost', 4),         # ceil(106 M / 30 M): out to the maximum
    (FEW_LARGE, 'inflight', 1),     # ceil(3 / 4): in
    (MANY_SMALL, 'cost', 1),        # ceil(21 M / 30 M): in
    (MANY_SMALL, 'inflight', 4),    # ceil(16 / 4): out
], ids=['few-large-on-cost', 'few-large-on-inflight', 'many-small-on-cost', 'many-small-on-inflight'])
def test_the_metric_decides_what_a_mixed_workload_scales_to(load, metric, replicas):
    healths = [probed(*replica) for replica in load]
    st = stage(autoscaled(metric), status={'autoscaling': {'desiredReplicas': 2}})
    pods = [pod(st, 0), pod(st, 1)]
    observed = world(st, pods)
    now = parse_time(observed.now)
    observed = dataclasses.replace(observed, health={p['metadata']['uid']: h for p, h in zip(pods, healths)},
                                   load_samples=((now - 1, demand(healths, metric)),))
    plan = reconcile(st, observed)
    decided = plan.status['autoscaling']
    assert (decided['metric'], decided['desiredReplicas']) == (metric, replicas)
    assert decided['metricValue'] == demand(healths, metric)
    assert decided['reason'].startswith('outstanding pixel-steps' if metric == 'cost' else 'in-flight')
    created = sorted(p['metadata']['name'] for p in plan.create if p['kind'] == 'Pod')
    if replicas > 2:                                     # scaled out: the new replicas are created at once
        assert created == ['s-2', 's-3'] and decided['reason'].endswith('scale up to 4')
    else:                                                # scaled in: one replica leaves through the drain
        assert created == [] and decided['reason'].endswith('scale down to 1')
        assert any(p.kind == 'Pod' for p in plan.patch) or any(d.kind == 'Pod' for d in plan.delete)


def test_cost_demand_sums_the_replicas_outstanding_pixel_steps_and_ignores_the_request_count():
    few, many = [probed(*r) for r in FEW_LARGE], [probed(*r) for r in MANY_SMALL]
    assert demand(few, 'cost') == 2 * BIG + SMALL and demand(few, 'inflight') == 3
    assert demand(many, 'cost') == 16 * SMALL and demand(many, 'inflight') == 16
    assert demand([PodHealth('Healthy', 0.0, answered=True, waiting=1, running=1)], 'cost') == 0   # an older stage
