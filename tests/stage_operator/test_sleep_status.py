"""Sleeping replicas in the operator (spec.sleep): the probe keeps `/v1/stats.sleep`, the status counts the ready
replicas asleep (status.sleepingReplicas, the SLEEPING column) and marks each (replicaStatuses[].sleeping); a sleeping
replica is still ready, healthy, never restarted, and to the autoscaler and the drain it is an idle replica."""
from __future__ import annotations

import dataclasses

import aiohttp
import pytest
from aiohttp import web

from stage_operator import autoscale, scaledown, stage_gauges
from stage_operator.health import HealthBook, PodHealth, ProbeResult
from stage_operator.reconcile import reconcile
from stage_operator.stage_http import probe, sleep_report
from support.reconcile_world import CPU, pod, stage, world

SLEEPY = {**CPU, 'sleep': {'afterIdle': '5s'}}
ASLEEP = {'is_sleeping': True, 'level': 1, 'sleeps_total': 3, 'wakes_total': 2}
AWAKE = {'is_sleeping': False, 'level': None, 'sleeps_total': 3, 'wakes_total': 3}


def health(sleep, waiting=0, running=0) -> PodHealth:
    return PodHealth('Healthy', 1.0, answered=True, state='ready', waiting=waiting, running=running, sleep=sleep)


def status_of(spec, sleeps, states=('ready', 'ready')):
    st = stage(spec)
    observed = world(st, [pod(st, i, state) for i, state in enumerate(states)])
    book = {f'pod-{i}': health(s) for i, s in enumerate(sleeps)}
    return reconcile(st, dataclasses.replace(observed, health=book)).status


# -- what the probe keeps ------------------------------------------------------------------------------------
@pytest.mark.parametrize('stats, kept', [
    (ASLEEP, ASLEEP), (AWAKE, AWAKE),
    ({'is_sleeping': True, 'level': 2}, {'is_sleeping': True, 'level': 2, 'sleeps_total': 0, 'wakes_total': 0}),
    ({'is_sleeping': 'yes'}, None), ({'level': 1}, None), (None, None), ([], None),
], ids=['asleep', 'awake', 'no-counters', 'not-a-bool', 'no-flag', 'absent', 'not-an-object'])
def test_the_probe_keeps_whether_the_stage_sleeps(stats, kept):
    assert sleep_report(stats) == kept


async def test_the_probe_reads_stats_sleep_and_a_change_wakes_the_reconcile():
    answers = [ASLEEP]
    app = web.Application()
    app.router.add_get('/health', lambda r: web.json_response({'status': 'ok'}))  # asleep: still 200
    app.router.add_get('/v1/stats', lambda r: web.json_response({'state': 'ready', 'waiting': 0, 'running': 0,
                                                                 'sleep': answers[-1]}))
    app.router.add_get('/v1/loras', lambda r: web.json_response({'data': []}))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, '127.0.0.1', 0)
    await site.start()
    base = f'http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}'
    book = HealthBook()
    try:
        async with aiohttp.ClientSession() as session:
            first = await probe(session, base, 5)
            seen, changed = book.record('uid', first)
            assert first.sleep == ASLEEP and changed and seen.sleeping and seen.health == 'Healthy'
            _, changed = book.record('uid', await probe(session, base, 5))
            assert not changed, 'still asleep: nothing to write'
            answers.append(AWAKE)
            seen, changed = book.record('uid', await probe(session, base, 5))
            assert changed and not seen.sleeping, 'woke: the count changes'
    finally:
        await runner.cleanup()
    seen, _ = book.record('uid', ProbeResult(9.0, error='ClientConnectorError'))
    assert seen.health == 'Unreachable' and seen.sleep == AWAKE, 'one missed probe changes nothing it said'


# -- the status ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize('sleeps, count', [((ASLEEP, AWAKE), 1), ((ASLEEP, ASLEEP), 2), ((AWAKE, AWAKE), 0),
                                           ((ASLEEP, None), 1), ((None, None), 0)],
                         ids=['one-asleep', 'both-asleep', 'awake', 'one-unreported', 'none-reported'])
def test_sleeping_replicas_counts_the_ready_replicas_asleep_and_they_stay_ready(sleeps, count):
    status = status_of(SLEEPY, sleeps)
    assert status['sleepingReplicas'] == count
    assert status['readyReplicas'] == 2 and status['phase'] == 'Ready', 'asleep is ready (a request wakes it)'
    ready = next(c for c in status['conditions'] if c['type'] == 'Ready')
    assert (ready['status'], ready['reason']) == ('True', 'AllReplicasReady')
    degraded = next(c for c in status['conditions'] if c['type'] == 'Degraded')
    assert degraded['status'] == 'False', 'never a failure'
    by_pod = {r['pod']: r for r in status['replicaStatuses']}
    for i, s in enumerate(sleeps):
        replica = by_pod[f's-{i}']
        assert replica.get('sleeping') == (None if s is None else s['is_sleeping'])
        assert replica['health'] == 'Healthy' and replica['ready']


def test_a_replica_that_is_not_ready_is_not_counted():
    status = status_of(SLEEPY, (ASLEEP, ASLEEP), states=('ready', 'starting'))
    assert status['sleepingReplicas'] == 1 and status['readyReplicas'] == 1


def test_without_spec_sleep_there_is_no_count():
    assert 'sleepingReplicas' not in status_of(CPU, (None, None))


def test_the_operator_gauge_counts_them():
    stage_gauges.publish('ns', 'sleepy', {'readyReplicas': 2, 'sleepingReplicas': 1}, 2)
    sample = stage_gauges.REPLICAS.labels('ns', 'sleepy', 'sleeping')._value.get()
    stage_gauges.forget('ns', 'sleepy')
    assert sample == 1.0


# -- health, restarts, autoscaling, drain -------------------------------------------------------------------
def test_a_sleeping_replica_is_never_failed_nor_restarted():
    st = stage(SLEEPY)
    observed = world(st, [pod(st, 0), pod(st, 1)])
    plan = reconcile(st, dataclasses.replace(observed, health={'pod-0': health(ASLEEP), 'pod-1': health(ASLEEP)}))
    assert health(ASLEEP).failed(3, True) is None
    assert plan.delete == [] and plan.create == []


def test_to_the_autoscaler_a_sleeping_replica_is_an_idle_replica():
    """Its /v1/stats says 0 waiting and 0 running: it adds no demand, and it counts as a replica like any other, so
    an idle stage scales to minReplicas (never below: 0 is refused with mode Operator), asleep or not."""
    assert autoscale.demand([health(ASLEEP), health(AWAKE)]) == autoscale.demand([health(None), health(None)]) == 0
    waking = health(ASLEEP, waiting=3)  # requests that reached it wait for the wake: they are demand
    assert autoscale.demand([waking, health(ASLEEP)]) == 3
    spec = stage({**SLEEPY, 'autoscaling': {'mode': 'Operator', 'minReplicas': 1, 'maxReplicas': 4}}).spec
    desired, _, _ = autoscale.decide(spec, {'desiredReplicas': 2}, [(0.0, 0), (400.0, 0)], 400.0)
    assert desired == 1


def test_the_drain_removes_a_sleeping_idle_replica_like_an_awake_idle_one():
    st = stage(SLEEPY)
    pods = world(st, [pod(st, 0), pod(st, 1)]).pod_views()
    book = {'pod-0': health(ASLEEP), 'pod-1': health(AWAKE)}
    order = sorted(pods.values(), key=lambda p: scaledown.victim_order(p, book.get(p.uid), None))
    assert [p.name for p in order] == ['s-1', 's-0'], 'the highest index first, asleep or not'
