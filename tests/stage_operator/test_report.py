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


COMPILE = {**CPU, 'compile': {'mode': 'regional'}}
REGIONAL = {'mode': 'regional', 'mode_effective': 'regional', 'reason': None, 'auto': None, 'graphs': 4,
            'recompiles': 0, 'graph_limit_reached': False, 'cold_compile_s': 12.34, 'cache': 'miss'}
EAGER = {**REGIONAL, 'mode_effective': 'none', 'reason': 'the warm-up compile ran past compile.timeout_s=900',
         'graphs': 0, 'cold_compile_s': None}
NO_VERDICT = 'no compile measurement of DiTPipeline on cpu (bench/compile.py --write-verdicts on such a device adds one)'
AUTO_EAGER = {**REGIONAL, 'mode': 'auto', 'mode_effective': 'none', 'auto': NO_VERDICT, 'graphs': 0, 'cache': None}


def _compiled(spec, reports, status=None, states=('ready', 'ready')):
    """The Compiled condition (None: absent) and the plan's events, with each pod's /v1/stats.compile as probed."""
    import dataclasses

    from stage_operator.health import PodHealth

    st = stage(spec, status=status)
    observed = world(st, [pod(st, i, state) for i, state in enumerate(states)])
    health = {f'pod-{i}': PodHealth('Healthy', 1.0, answered=True, state='ready', waiting=0, running=0, compile=c)
              for i, c in enumerate(reports)}
    plan = reconcile(st, dataclasses.replace(observed, health=health))
    written = plan.status if plan.status is not None else status  # None: nothing changed, no write
    found = [c for c in written['conditions'] if c['type'] == 'Compiled']
    return (found[0] if found else None), plan


@pytest.mark.parametrize('spec', [CPU, {**CPU, 'compile': {'mode': 'none', 'shapes': ['64x64']}}],
                         ids=['no-compile', 'mode-none'])
def test_no_compiled_condition_when_nothing_is_compiled(spec):
    condition_, plan = _compiled(spec, [None, None])
    assert condition_ is None and plan.status['phase'] == 'Ready'


def test_compiled_when_every_ready_replica_compiled_naming_mode_graphs_seconds_and_cache():
    condition_, plan = _compiled(COMPILE, [REGIONAL, {**REGIONAL, 'cold_compile_s': 0.8, 'cache': 'hit',
                                                      'graph_limit_reached': True}])
    assert (condition_['status'], condition_['reason']) == ('True', 'Compiled')
    assert condition_['message'] == ('s-0: regional, 4 graphs, 0 recompiles, cold compile 12.3 s, cache miss; '
                                     's-1: regional, 4 graphs, 0 recompiles, cold compile 0.8 s, cache hit, graph '
                                     'limit reached (new shapes run eagerly)')
    assert [c['type'] for c in plan.status['conditions']][-1] == 'Compiled', 'after the five of every stage'
    assert plan.status['phase'] == 'Ready'
    assert not [e for e in plan.events if e['type'] == 'Warning']


def test_a_fallback_is_a_false_condition_with_the_runtimes_reason_and_the_replica_keeps_serving():
    condition_, plan = _compiled(COMPILE, [REGIONAL, EAGER])
    assert (condition_['status'], condition_['reason']) == ('False', 'CompileFallback')
    assert condition_['message'] == ('1/2 ready replicas fell back to eager: s-1: the warm-up compile ran past '
                                     'compile.timeout_s=900')
    assert (plan.status['phase'], plan.status['readyReplicas']) == ('Ready', 2), 'served eagerly: no phase change'
    assert not plan.delete and not plan.create, 'a fallback never restarts a replica'
    assert [(e['type'], e['reason'], e['message']) for e in plan.events if e['reason'] == 'CompileFallback'] == [
        ('Warning', 'CompileFallback', condition_['message'])]


def test_auto_that_chose_eager_is_false_with_the_measurement_it_followed_and_no_warning():
    condition_, plan = _compiled({**CPU, 'compile': {'mode': 'auto'}}, [AUTO_EAGER, AUTO_EAGER])
    assert (condition_['status'], condition_['reason']) == ('False', 'AutoChoseEager')
    assert condition_['message'] == f'2/2 ready replicas run eagerly, as compile.mode auto chose: {NO_VERDICT}'
    assert not [e for e in plan.events if e['type'] == 'Warning'], 'chosen, not suffered'
    failed, _ = _compiled({**CPU, 'compile': {'mode': 'auto'}},
                          [AUTO_EAGER, {**AUTO_EAGER, 'auto': 'DiTPipeline on cpu: regional (…)',
                                        'reason': 'compile failed: InductorError: no C compiler'}])
    assert (failed['status'], failed['reason']) == ('False', 'CompileFallback'), 'a failure outranks a choice'
    assert failed['message'] == '1/2 ready replicas fell back to eager: s-1: compile failed: InductorError: no C compiler'


def test_unknown_until_every_ready_replica_reported_and_only_ready_current_ones_count():
    condition_, _ = _compiled(COMPILE, [None, None])
    assert (condition_['status'], condition_['reason']) == ('Unknown', 'NotReported')
    condition_, _ = _compiled(COMPILE, [REGIONAL, None])
    assert condition_['status'] == 'Unknown' and condition_['message'].startswith('1/2 ready replicas reported')
    condition_, _ = _compiled(COMPILE, [REGIONAL, EAGER], states=('ready', 'starting'))
    assert (condition_['status'], condition_['reason']) == ('True', 'Compiled'), 'a replica not ready is not counted'


def test_the_last_verdict_on_the_same_revision_holds_while_no_replica_has_reported_then_zero_writes():
    _, plan = _compiled(COMPILE, [REGIONAL, REGIONAL])
    status = copy.deepcopy(plan.status)
    kept, again = _compiled(COMPILE, [None, None], status=status)  # an operator restarted: no probe yet
    assert (kept['status'], kept['reason']) == ('True', 'Compiled')
    assert again.status is None, 'nothing changed: no status write'
    rolled = {**status, 'templateHash': 'older'}
    fresh, _ = _compiled(COMPILE, [None, None], status=rolled)
    assert fresh['status'] == 'Unknown', 'a verdict on another revision is not kept'
