"""The status the operator reports (report.py, pure): the phase and the reason that explains it (the REASON
column), the GPUs a pod asks for (the GPUS column), and the status of a stage being deleted."""
from __future__ import annotations

import copy

import pytest

from stage_operator.conditions import condition
from stage_operator.observed import Observed
from stage_operator.reconcile import reconcile
from stage_operator.report import build_deleting_status, phase_of

from support.reconcile_world import CPU, GPU, T0, pod, stage, world

OK = {'Accepted': (True, 'TopologyValid'), 'Stalled': (False, 'NotStalled'), 'Degraded': (False, 'NoFailures'),
      'Ready': (True, 'AllReplicasReady'), 'Progressing': (False, 'Complete')}


def conditions(**changed):
    return [condition(kind, *changed.get(kind, OK[kind]), '') for kind in OK]


@pytest.mark.parametrize('changed, phase, reason', [
    ({}, 'Ready', 'AllReplicasReady'),
    ({'Stalled': (True, 'RestartBudgetExhausted'), 'Degraded': (True, 'ReplicaFailed')}, 'Stalled',
     'RestartBudgetExhausted'),
    ({'Accepted': (False, 'InsufficientGPUCapacity'), 'Ready': (False, 'ReplicasNotReady')}, 'Pending',
     'InsufficientGPUCapacity'),
    # the row: Degraded with every replica ready (a rolled-back rollout serves the old revision)
    ({'Degraded': (True, 'RolloutFailed')}, 'Degraded', 'RolloutFailed'),
    ({'Degraded': (True, 'ReplicaFailed'), 'Ready': (False, 'ReplicasNotReady')}, 'Degraded', 'ReplicaFailed'),
    ({'Ready': (False, 'ReplicasNotReady'), 'Progressing': (True, 'WaitingForGPUs')}, 'Progressing', 'WaitingForGPUs'),
    ({'Ready': (False, 'ReplicasNotReady')}, 'Progressing', 'ReplicasNotReady'),
], ids=['ready', 'stalled', 'pending', 'degraded-all-ready', 'degraded', 'progressing', 'not-ready'])
def test_the_reason_is_the_one_of_the_condition_that_decided_the_phase(changed, phase, reason):
    assert phase_of(conditions(**changed)) == (phase, reason)


@pytest.mark.parametrize('spec, gpus', [(CPU, 0), ({**CPU, 'resources': {'gpusPerPod': 2, 'gpuResourceName': ''},
                                                    'parallel': {'cfgParallelSize': 2}}, 0), (GPU, 2)],
                         ids=['cpu-1-rank', 'cpu-2-ranks', 'gpu-2'])
def test_topology_counts_gpus_only_for_a_gpu_resource(spec, gpus):
    st = stage(spec)
    status = reconcile(st, world(st, nodes=[])).status
    assert status['topology']['gpus'] == gpus
    assert status['topology']['gpusPerPod'] == spec['resources']['gpusPerPod'], 'the ranks per pod, as before'


def test_a_deleted_stage_is_terminating_and_keeps_what_still_holds():
    st = stage(CPU)
    ready = reconcile(st, world(st, [pod(st, 0), pod(st, 1)])).status
    deleting = stage(CPU, status=copy.deepcopy(ready), deletionTimestamp=T0)
    pods = Observed(pods=[pod(deleting, 0), pod(deleting, 1)], now='2026-01-01T00:09:00Z').pod_views()
    status = build_deleting_status(deleting, pods, leaving={'s-1'}, fenced={'s-0'}, now='2026-01-01T00:09:00Z')
    assert (status['phase'], status['reason'], status['replicas'], status['readyReplicas']) == (
        'Terminating', 'Draining', 1, 1)
    by_type = {c['type']: c for c in status['conditions']}
    assert (by_type['Ready']['status'], by_type['Ready']['reason']) == ('False', 'Terminating')
    assert by_type['Ready']['lastTransitionTime'] == '2026-01-01T00:09:00Z', 'Ready turned False now'
    assert by_type['Progressing']['message'] == 'the stage is being deleted: draining s-0'
    assert by_type['Accepted'] == next(c for c in ready['conditions'] if c['type'] == 'Accepted'), 'kept as it was'
    assert [(r['pod'], r.get('draining')) for r in status['replicaStatuses']] == [('s-0', True)]
    assert status['topology'] == ready['topology'] and status['templateHash'] == ready['templateHash']
    again = stage(CPU, status=copy.deepcopy(status), deletionTimestamp=T0)
    assert build_deleting_status(again, pods, {'s-1'}, set(), '2026-01-01T00:09:30Z') == status, \
        'nothing changed: the same status (no write)'


def test_a_stage_deleted_before_any_status_or_with_an_invalid_spec_is_terminating():
    for spec in (CPU, {**CPU, 'replicas': -1}):
        st = stage(spec, deletionTimestamp=T0)
        status = build_deleting_status(st, {}, set(), set(), T0)
        assert (status['phase'], status['replicas'], [c['type'] for c in status['conditions']]) == (
            'Terminating', 0, ['Ready', 'Progressing'])


def test_a_replica_whose_step_stalled_says_so():
    import dataclasses

    from stage_operator.health import PodHealth

    st = stage(CPU)
    observed = world(st, [pod(st, 0), pod(st, 1)])
    stalled = {'pod-0': PodHealth('Healthy', 1.0, answered=True, state='stalled', waiting=0, running=1)}
    replicas = reconcile(st, dataclasses.replace(observed, health=stalled)).status['replicaStatuses']
    assert replicas[0]['message'].startswith('stalled: a running step makes no progress')
    assert 'message' not in replicas[1]
