"""Operator autoscaling on the video job backlog (`autoscaling.metric: jobs`, issue 47): desired replicas =
ceil((queued + in progress) / targetJobsPerReplica) in [min, max]. Every replica reports the same store-wide counts
(/v1/stats jobs), so they are taken once, never summed; a replica that does not answer is no measurement."""
from __future__ import annotations

import dataclasses

import pytest
from support.reconcile_world import CPU, pod, stage, world

from stage_operator import stage_http
from stage_operator.api.spec import StageSpec
from stage_operator.autoscale import Policy, demand
from stage_operator.clock import parse_time
from stage_operator.controller import Controller, Targets
from stage_operator.health import PodHealth, ProbeResult
from stage_operator.reconcile import reconcile

JOBS = {'claimName': 'video-jobs'}
CLAIM = {'apiVersion': 'v1', 'kind': 'PersistentVolumeClaim', 'metadata': {'name': 'video-jobs', 'namespace': 'ns'},
         'spec': {'accessModes': ['ReadWriteMany']}, 'status': {'phase': 'Bound'}}


def counts(queued: int, in_progress: int, here: int = 0) -> dict[str, int]:
    return {'here': here, 'queued': queued, 'in_progress': in_progress, 'completed': 40, 'failed': 1}


def probed(jobs: dict[str, int] | None, running: int = 0) -> PodHealth:
    return PodHealth('Healthy', 0.0, answered=True, state='ready', waiting=0, running=running, jobs=jobs)


def autoscaled(**extra) -> dict:
    return {**CPU, 'jobs': JOBS, 'autoscaling': {
        'mode': 'Operator', 'minReplicas': 1, 'maxReplicas': 4, 'metric': 'jobs', 'scaleUpStabilizationSeconds': 0,
        'scaleDownStabilizationSeconds': 0, **extra}}


def test_the_store_wide_counts_are_taken_once_never_summed_over_the_replicas():
    both = [probed(counts(5, 2, here=1), running=1), probed(counts(5, 2, here=1), running=1)]
    assert demand(both, 'jobs') == 7, 'two replicas see the same store: 7 jobs, not 14'
    assert demand(both, 'inflight') == 2 + 5                    # inflight: their requests + the queue, once
    lagging = [probed(counts(6, 1)), probed(counts(3, 2))]      # one replica's last scan is older
    assert demand(lagging, 'jobs') == 7
    assert demand([probed(None), probed(counts(2, 1))], 'jobs') == 3, 'a replica without counts adds nothing'
    assert demand([probed(None)], 'jobs') == 0 and demand([], 'jobs') == 0


@pytest.mark.parametrize('jobs, target, desired', [
    (0, 1, 1),      # an empty store: down to minReplicas
    (3, 1, 3),
    (7, 2, 4),      # ceil(7 / 2)
    (100, 1, 4),    # clamped to maxReplicas
], ids=['empty-to-min', 'one-per-replica', 'two-per-replica', 'clamped-to-max'])
def test_the_recommendation_is_the_backlog_over_the_target_within_the_bounds(jobs, target, desired):
    policy = Policy.of(StageSpec.model_validate(autoscaled(targetJobsPerReplica=target)))
    assert (policy.metric, policy.target) == ('jobs', target)
    assert policy.recommend(jobs) == desired


def test_the_target_defaults_to_the_jobs_a_replica_claims_at_once():
    assert Policy.of(StageSpec.model_validate(autoscaled())).target == 1       # engine.maxNumSeqs' default
    spec = StageSpec.model_validate({**autoscaled(), 'engine': {'maxNumSeqs': 3}})
    assert Policy.of(spec).target == 3


@pytest.mark.parametrize('store, replicas', [((9, 2), 4), ((1, 0), 1)], ids=['backlog-scales-out', 'idle-scales-in'])
def test_the_reconcile_scales_on_the_backlog_and_reports_it(store, replicas):
    healths = [probed(counts(*store)), probed(counts(*store))]
    st = stage(autoscaled(targetJobsPerReplica=3), status={'autoscaling': {'desiredReplicas': 2}})
    pods = [pod(st, 0), pod(st, 1)]
    observed = dataclasses.replace(world(st, pods), jobs_claim=CLAIM)
    now = parse_time(observed.now)
    observed = dataclasses.replace(observed, health={p['metadata']['uid']: h for p, h in zip(pods, healths)},
                                   load_samples=((now - 1, demand(healths, 'jobs')),))
    decided = reconcile(st, observed).status['autoscaling']
    assert (decided['metric'], decided['desiredReplicas'], decided['metricValue']) == ('jobs', replicas, sum(store))
    assert decided['reason'].startswith('video jobs queued + in progress ')
    assert decided['reason'].endswith(f'over target 3 per replica for 0s: scale up to {replicas}' if replicas > 2
                                      else f'(target 3 per replica): scale down to {replicas}')


async def test_the_prober_records_the_backlog_once_and_a_replica_that_did_not_answer_is_left_out(monkeypatch):
    answers = {'http://a': ProbeResult(1.0, state='ready', waiting=0, running=1, jobs=counts(4, 2, here=1)),
               'http://b': ProbeResult(1.0, state='ready', waiting=0, running=1, jobs=counts(4, 2, here=1)),
               'http://c': ProbeResult(1.0, error='connection refused')}

    async def probe(session, url, timeout, api_key=None):
        return answers[url]

    monkeypatch.setattr(stage_http, 'probe', probe)
    controller = Controller(kube=None, clock=lambda: 100.0)
    memory = controller.remember('ns', 's')
    memory.targets = Targets(1.0, 1.0, True, 60.0, 'jobs', {
        'u-a': ('s-0', 'http://a', True), 'u-b': ('s-1', 'http://b', True), 'u-c': ('s-2', 'http://c', True)})
    await controller.probe_round('ns', 's')
    assert (memory.metric, list(memory.samples)) == ('jobs', [(100.0, 6)])
    answers.clear()
    answers.update({u: ProbeResult(2.0, error='timed out') for u in ('http://a', 'http://b', 'http://c')})
    await controller.probe_round('ns', 's')
    assert list(memory.samples) == [(100.0, 6)], 'no answer is no measurement (never a scale-down to 0 jobs)'
    await controller.close()
