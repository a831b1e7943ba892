"""Table-driven cases for the pure `reconcile(stage, observed) -> Plan`: no API, no kopf."""
from __future__ import annotations

import copy
import dataclasses

import pytest

from stage_operator.builders.children import build_configmap, build_service
from stage_operator.builders.networkpolicy import build_network_policy
from stage_operator.builders.pod import template_hash
from stage_operator.observed import Observed
from stage_operator.reconcile import needs_nodes, reconcile

from support.reconcile_world import CPU, GPU, T0, T1, apply_merge, node, pod, settle, stage, world


def created(plan) -> list[str]:
    return [f"{o['kind']}/{o['metadata']['name']}" for o in plan.create]


def deleted(plan) -> list[str]:
    return [d.name for d in plan.delete]


def cond(status: dict, kind: str) -> dict:
    return next(c for c in status['conditions'] if c['type'] == kind)


# ---- the table: (case, spec, pods as (index, state, outdated?), expected creates, deletes, conditions) ----
CASES = [
    ('create', CPU, [], False,
     ['ConfigMap/s-config', 'Service/s', 'PodDisruptionBudget/s', 'NetworkPolicy/s', 'Pod/s-0', 'Pod/s-1'], [],
     {'Accepted': 'True', 'Progressing': 'ReplicasStarting', 'Ready': 'False'}, 'Progressing'),
    ('steady', CPU, [(0, 'ready', False), (1, 'ready', False)], True, [], [],
     {'Ready': 'True', 'Progressing': 'Complete', 'Degraded': 'False'}, 'Ready'),
    ('scale-up', {**CPU, 'replicas': 3}, [(0, 'ready', False), (1, 'ready', False)], True, ['Pod/s-2'], [],
     {'Progressing': 'ReplicasStarting', 'Ready': 'False'}, 'Progressing'),
    ('rollout-first-step', CPU, [(0, 'ready', True), (1, 'ready', True)], True, [], [],  # s-0 drained first
     {'Progressing': 'RollingUpdate', 'Ready': 'False'}, 'Progressing'),
    ('rollout-waits-for-replacement', CPU, [(0, 'starting', False), (1, 'ready', True)], True, [], [],
     {'Progressing': 'RollingUpdate'}, 'Progressing'),
    ('rollout-recreates-deleted', CPU, [(1, 'ready', True)], True, ['Pod/s-0'], [],
     {'Progressing': 'RollingUpdate'}, 'Progressing'),
    ('rollout-replaces-unready-outdated', CPU, [(0, 'pending', True), (1, 'ready', True)], True, [], ['s-0'],
     {'Progressing': 'RollingUpdate'}, 'Progressing'),
    ('rollout-no-new-pod-while-terminating', CPU, [(0, 'terminating', True), (1, 'ready', True)], True, [], [],
     {'Progressing': 'RollingUpdate'}, 'Progressing'),
    ('pod-failed', CPU, [(0, 'failed', False), (1, 'ready', False)], True, [], [],
     {'Degraded': 'True', 'Ready': 'False'}, 'Degraded'),
    ('pod-unschedulable', CPU, [(0, 'unschedulable', False), (1, 'ready', False)], True, [], [],
     {'Progressing': 'WaitingForGPUs', 'Degraded': 'False'}, 'Progressing'),
    ('scale-to-zero', {**CPU, 'replicas': 0}, [], True, [], [], {'Ready': 'True', 'Progressing': 'Complete'}, 'Ready'),
]


DRAINED = {'rollout-first-step': [('Pod', 's-0')]}


def plan_case(spec, pods) -> str:
    return next(c[0] for c in CASES if c[1] == spec and c[2] == pods)


@pytest.mark.parametrize('spec, pods, children, creates, deletes, conditions, phase', [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_reconcile_table(spec, pods, children, creates, deletes, conditions, phase):
    st = stage(spec)
    old = stage({**spec, 'image': 'diffstage/runtime:old'})
    observed = world(st, [pod(old if outdated else st, i, state) for i, state, outdated in pods], children=children)
    plan = reconcile(st, observed)
    assert created(plan) == creates
    assert deleted(plan) == deletes
    fenced = [('Pod', f's-{i}') for i, state, outdated in pods if state == 'failed' and not outdated]
    drained = [(p.kind, p.name) for p in plan.patch if 'diffstage.io/drain-reason' in p.body['metadata'].get(
        'annotations', {})]
    assert [(p.kind, p.name) for p in plan.patch if (p.kind, p.name) not in drained] == fenced  # failed: out at once
    assert drained == DRAINED.get(plan_case(spec, pods), [])  # an outdated ready pod leaves through the drain
    for kind, expected in conditions.items():
        c = cond(plan.status, kind)
        column = 'status' if expected in ('True', 'False', 'Unknown') else 'reason'   # a status or a reason
        assert c[column] == expected, (kind, column, c)
        assert c['observedGeneration'] == 1 and c['lastTransitionTime'] == T1
    assert plan.status['phase'] == phase and plan.status['observedGeneration'] == 1


def test_a_manual_scale_down_fences_the_removed_replicas_and_deletes_them_once_drained():
    """kubectl scale (no operator autoscaling): the removed replicas leave the Service first and are deleted
    only when a probe taken after the fence sees nothing in flight — no request is lost to a scale-down."""
    from stage_operator.health import PodHealth
    from stage_operator.scaledown import fence

    st = stage({**CPU, 'replicas': 1})
    pods = [pod(st, i) for i in range(3)]
    t_fence = 1767225900.0                                    # T1 in epoch seconds
    first = reconcile(st, world(st, pods))
    assert deleted(first) == [] and created(first) == []
    assert [(p.name, p.body) for p in first.patch] == [('s-2', fence(t_fence)), ('s-1', fence(t_fence))]
    for obj in pods[1:]:                                      # the API applied the fences
        apply_merge(obj['metadata'], fence(t_fence)['metadata'])
    busy = {'pod-1': PodHealth('Healthy', t_fence + 5, answered=True, waiting=0, running=1),
            'pod-2': PodHealth('Healthy', t_fence + 5, answered=True, waiting=0, running=0)}
    second = reconcile(st, Observed(pods=pods, service=build_service(st), configmap=build_configmap(st),
                                    now='2026-01-01T00:05:10Z', health=busy))
    assert deleted(second) == ['s-2'] and second.requeue_after is not None      # s-1 still finishing its work
    busy['pod-1'] = PodHealth('Healthy', t_fence + 9, answered=True, waiting=0, running=0)
    third = reconcile(st, Observed(pods=pods, service=build_service(st), configmap=build_configmap(st),
                                   now='2026-01-01T00:05:10Z', health=busy))
    assert sorted(deleted(third)) == ['s-1', 's-2']


def test_capacity_missing_creates_nothing_and_names_the_largest_node():
    st = stage(GPU)
    plan = reconcile(st, world(st, children=False, nodes=[node('small', 1), node('big', 1), node('cordoned', 8, True)]))
    assert plan.create == [] and plan.delete == []
    accepted = cond(plan.status, 'Accepted')
    assert (accepted['status'], accepted['reason']) == ('False', 'InsufficientGPUCapacity')
    assert accepted['message'] == 'gpusPerPod=2 of nvidia.com/gpu fits no schedulable node: the largest is small with 1 allocatable'
    assert plan.status['phase'] == 'Pending'
    fits = reconcile(st, world(st, children=False, nodes=[node('small', 1), node('fits', 2)]))
    assert created(fits) == ['ConfigMap/s-config', 'Service/s', 'NetworkPolicy/s', 'Pod/s-0']
    assert cond(fits.status, 'Accepted')['status'] == 'True'


@pytest.mark.parametrize('nodes, message', [
    ([], 'gpusPerPod=2 of nvidia.com/gpu cannot be placed: the cluster has no nodes'),
    ([node('a', 8, True)], 'gpusPerPod=2 of nvidia.com/gpu cannot be placed: no node is schedulable'),
    ([node('a', 0)], 'gpusPerPod=2 of nvidia.com/gpu fits no schedulable node: the largest is a with 0 allocatable'),
])
def test_capacity_messages(nodes, message):
    st = stage(GPU)
    assert cond(reconcile(st, world(st, children=False, nodes=nodes)).status, 'Accepted')['message'] == message


def test_nodes_are_read_only_when_gpus_must_be_placed():
    assert not needs_nodes(stage(CPU), world(stage(CPU), children=False))  # CPU ranks: no check
    st = stage(GPU)
    assert needs_nodes(st, world(st))  # a replica to create
    assert not needs_nodes(st, world(st, [pod(st, 0)]))  # all there: nothing to place
    rejected = stage(GPU, status={'conditions': [{'type': 'Accepted', 'status': 'False'}]})
    assert needs_nodes(rejected, world(rejected, [pod(rejected, 0)]))  # re-check a failed check


def test_a_deleted_stage_drains_every_pod_before_it_goes():
    """CR deletion is one more removal through the drain: running pods are fenced, a pod with no work is
    deleted at once, a fenced pod once a probe after the fence sees nothing in flight. The status says
    Terminating from the first reconcile on, and is written again only when a pod leaves."""
    from stage_operator.health import PodHealth
    from stage_operator.scaledown import fence

    ready, _ = settle(stage(CPU), world(stage(CPU), [pod(stage(CPU), 0), pod(stage(CPU), 1, 'pending')]))
    st = stage(CPU, status=dict(ready.status), deletionTimestamp=T0)
    t1 = 1767225900.0
    pods = [pod(st, 0), pod(st, 1, 'pending')]
    first = reconcile(st, world(st, pods))
    assert [(p.name, p.body) for p in first.patch] == [('s-0', fence(t1, 'StageDeleted'))]
    assert [(d.name, d.reason) for d in first.delete] == [('s-1', 'StageDeleted')]
    assert first.requeue_after is not None and first.create == []
    assert (first.status['phase'], first.status['reason'], first.status['replicas']) == ('Terminating', 'Draining', 1)
    assert [r['pod'] for r in first.status['replicaStatuses']] == ['s-0'] and first.status['replicaStatuses'][0][
        'draining'] is True
    status = copy.deepcopy(dict(st.status))
    apply_merge(status, first.status)
    st = stage(CPU, status=status, deletionTimestamp=T0)
    apply_merge(pods[0]['metadata'], fence(t1, 'StageDeleted')['metadata'])
    busy = {'pod-0': PodHealth('Healthy', t1 + 1, answered=True, waiting=0, running=1)}
    waiting = reconcile(st, Observed(pods=pods[:1], now='2026-01-01T00:05:02Z', health=busy))
    assert waiting.delete == [] and waiting.patch == [] and waiting.requeue_after is not None
    assert waiting.status is None and waiting.events == [], 'nothing changed while it drains: nothing written'
    idle = {'pod-0': PodHealth('Healthy', t1 + 2, answered=True, waiting=0, running=0)}
    done = reconcile(st, Observed(pods=pods[:1], now='2026-01-01T00:05:03Z', health=idle))
    assert [(d.name, d.reason) for d in done.delete] == [('s-0', 'StageDeleted')] and done.requeue_after is None
    assert [e['reason'] for e in done.events] == ['DeletedPods']
    assert (done.status['replicas'], done.status['readyReplicas'], done.status['replicaStatuses']) == (0, 0, [])
    assert cond(done.status, 'Progressing')['message'] == 'the stage is being deleted: every pod has drained'


def test_invalid_spec_creates_nothing_and_stalls():
    st = stage({**CPU, 'parallel': {'cfgParallelSize': 2}, 'resources': {'gpusPerPod': 3, 'gpuResourceName': ''}})
    assert st.spec is None and 'num_gpus=3 is not divisible' in st.error
    plan = reconcile(st, world(stage(CPU), children=False))
    assert plan.create == [] and plan.status['phase'] == 'Stalled'
    assert cond(plan.status, 'Accepted')['reason'] == 'InvalidSpec' and 'spec: parallel topology' in cond(
        plan.status, 'Accepted')['message']
    assert cond(plan.status, 'Stalled')['status'] == 'True'


def test_second_reconcile_of_a_settled_stage_writes_nothing_and_keeps_transition_times():
    st = stage(CPU)
    pods = [pod(st, 0), pod(st, 1)]
    st, first = settle(st, world(st, pods, now=T0))
    assert first.status is not None
    again = reconcile(st, world(st, pods, now=T1))
    assert again.writes == 0, again.summary()
    # one replica fails: only the conditions whose status flips get the new time
    failed = [pod(st, 0, 'failed'), pod(st, 1)]
    plan = reconcile(st, world(st, failed, now=T1))
    assert cond(plan.status, 'Degraded')['lastTransitionTime'] == T1
    assert 'conditions' in plan.status and cond(plan.status, 'Accepted')['lastTransitionTime'] == T0


def test_spec_change_moves_the_generation_and_the_hash():
    st = stage(CPU, generation=1)
    changed = stage({**CPU, 'engine': {'maxNumSeqs': 8}}, generation=2)
    assert template_hash(changed) != template_hash(st)
    assert template_hash(stage({**CPU, 'replicas': 5})) == template_hash(st), 'scaling is not a rollout'
    plan = reconcile(changed, world(st, [pod(st, 0), pod(st, 1)]))  # children built from the old spec
    assert deleted(plan) == [] and plan.status['observedGeneration'] == 2
    assert [(p.kind, p.name) for p in plan.patch] == [('Pod', 's-0'), ('ConfigMap', 's-config')]
    assert plan.patch[0].body['metadata']['annotations']['diffstage.io/drain-reason'] == 'Outdated', 'drained'


def test_failed_pod_is_reported_with_its_termination_message():
    st = stage(CPU)
    plan = reconcile(st, world(st, [pod(st, 0, 'failed'), pod(st, 1)]))
    replica = plan.status['replicaStatuses'][0]
    assert replica['lastFailure'] == {'reason': 'EngineDead', 'message': 'collective timed out', 'exitCode': 3, 'time': T0}
    assert cond(plan.status, 'Degraded')['message'] == 's-0: EngineDead (exit code 3): collective timed out'


def test_children_that_drifted_are_patched_back():
    st = stage(CPU)
    service = build_service(st)
    service['spec']['selector'] = {'app': 'someone-else'}
    service['spec']['clusterIP'] = '10.0.0.1'  # server-added fields are not drift
    observed = Observed(pods=[pod(st, 0), pod(st, 1)], service=service, configmap=build_configmap(st), now=T1)
    plan = reconcile(st, observed)
    assert [(p.kind, p.name) for p in plan.patch] == [('Service', 's')]
    assert plan.patch[0].body['spec']['selector'] == {'diffstage.io/stage': 's', 'diffstage.io/serving': 'true'}


def test_decisions_are_explained_by_events_once():
    st = stage(GPU)
    nodes = [node('small', 1)]
    st, plan = settle(st, world(st, children=False, nodes=nodes))
    assert [(e['type'], e['reason']) for e in plan.events] == [('Warning', 'InsufficientGPUCapacity')]
    assert plan.events[0]['involvedObject'] == {'apiVersion': 'diffstage.io/v1alpha1', 'kind': 'DiffusionStage',
                                                'name': 's', 'namespace': 'ns', 'uid': 'uid-1'}
    assert reconcile(st, world(st, children=False, nodes=nodes)).events == [], 'a lasting condition: one event'
    fits = reconcile(st, world(st, children=False, nodes=[node('big', 8)]))
    assert [(e['reason'], e['message']) for e in fits.events] == [('CreatedPods', 'created s-0')]
    scaled = stage({**CPU, 'replicas': 1})
    down = reconcile(scaled, world(scaled, [pod(scaled, 0), pod(scaled, 1)]))
    assert [(e['reason'], e['message']) for e in down.events] == [
        ('DrainingReplica', 'fenced s-1 for a scale-down to 1; deleted once idle (at most 60s)')]


def test_the_network_policy_is_an_owned_child_kept_as_built_and_removed_when_disabled():
    st = stage()
    pods = [pod(st, 0), pod(st, 1)]
    assert reconcile(st, world(st, pods)).create == [], 'present and as built: nothing to write'
    missing = dataclasses.replace(world(st, pods), network_policy=None)
    assert [o['kind'] for o in reconcile(st, missing).create] == ['NetworkPolicy']
    edited = copy.deepcopy(build_network_policy(st))
    edited['spec']['ingress'][1]['from'] = [{'podSelector': {}}]  # someone opened ZMQ to the namespace
    patched = reconcile(st, dataclasses.replace(world(st, pods), network_policy=edited)).patch
    assert [(p.kind, p.name) for p in patched] == [('NetworkPolicy', 's')]
    assert patched[0].body['spec'] == build_network_policy(st)['spec']
    off = stage({**CPU, 'networkPolicy': {'enabled': False}})
    plan = reconcile(off, world(off, [pod(off, 0), pod(off, 1)]))
    assert [(d.kind, d.name, d.reason) for d in plan.delete] == [('NetworkPolicy', 's', 'NetworkPolicyDisabled')]
    assert not any(e['reason'] == 'DeletedPods' for e in plan.events)
    assert reconcile(off, dataclasses.replace(world(off, [pod(off, 0), pod(off, 1)]), network_policy=None)).delete == []


def test_a_gated_pod_reports_waiting_for_quota_and_counts_no_restart():
    """Kueue (or any quota controller) holds the pod with a scheduling gate: Progressing/WaitingForQuota."""
    st = stage({**CPU, 'replicas': 1, 'podTemplate': {'labels': {'kueue.x-k8s.io/queue-name': 'q'}}})
    gated = pod(st, 0, 'pending')
    gated['spec']['schedulingGates'] = [{'name': 'kueue.x-k8s.io/admission'}]
    gated['status'] = {'phase': 'Pending', 'conditions': [{'type': 'PodScheduled', 'status': 'False',
                                                           'reason': 'SchedulingGated'}]}
    plan = reconcile(st, world(st, [gated]))
    progressing = next(c for c in plan.status['conditions'] if c['type'] == 'Progressing')
    assert (progressing['status'], progressing['reason']) == ('True', 'WaitingForQuota')
    assert 's-0 (kueue.x-k8s.io/admission)' in progressing['message']
    assert plan.status['replicaStatuses'][0]['message'] == 'waiting for quota: scheduling gates kueue.x-k8s.io/admission'
    assert plan.status['restarts']['total'] == 0 and plan.delete == [] and plan.create == []


RESTART_POLICY = {'maxRestarts': 2, 'windowSeconds': 600, 'backoffInitialSeconds': 1, 'backoffMaxSeconds': 1}


def _budget_spent():
    """Replica 0 crash-looped through its budget (2 restarts within the window): Stalled, its failed pod kept."""
    st = stage({**CPU, 'restartPolicy': RESTART_POLICY})
    pods = [pod(st, 0, 'failed'), pod(st, 1)]
    spent = {'index': 0, 'pod': 's-0', 'phase': 'Failed', 'restarts': 2,
             'recentRestarts': ['2026-01-01T00:03:00.000Z', '2026-01-01T00:04:00.000Z']}
    st = stage(st.spec.wire(), {'observedGeneration': 1, 'templateHash': template_hash(st), 'replicaStatuses': [spent]})
    st, plan = settle(st, world(st, pods))
    assert cond(plan.status, 'Stalled')['reason'] == 'RestartBudgetExhausted'
    st, plan = settle(st, world(st, pods))  # the same generation: sticky
    assert st.status['replicaStatuses'][0]['budgetExhausted'] is True and deleted(plan) == []
    return st, pods


@pytest.mark.parametrize('change', [{'replicas': 3}, {'abort': {'id': 'a1', 'all': True}},
                                    {'autoscaling': {'mode': 'External'}},
                                    {'autoscaling': {'mode': 'Operator', 'minReplicas': 2, 'maxReplicas': 4}}],
                         ids=['scale', 'abort', 'hpa-mode', 'operator-autoscaling'])
def test_a_new_generation_that_builds_the_same_pods_keeps_a_spent_restart_budget(change):
    """kubectl scale or an HPA (/scale), a spec.abort, autoscaling settings: a new generation, but nothing the
    failing pod is built from or the budget is counted under: the stage stays Stalled, the failed pod kept."""
    st, pods = _budget_spent()
    bumped = stage({**st.spec.wire(), **change}, st.status, generation=2)
    for _ in range(2):  # the first reconcile of the new generation, and the next one
        bumped, plan = settle(bumped, world(bumped, pods))
        assert cond(bumped.status, 'Stalled')['reason'] == 'RestartBudgetExhausted'
        replica = bumped.status['replicaStatuses'][0]
        assert replica['budgetExhausted'] is True and len(replica['recentRestarts']) == 2
        assert 's-0' not in deleted(plan) and 's-0' not in [o['metadata']['name'] for o in plan.create]


@pytest.mark.parametrize('change', [{'restartPolicy': {**RESTART_POLICY, 'maxRestarts': 3}},
                                    {'engine': {'maxNumSeqs': 8}}], ids=['restart-policy', 'pod-template'])
def test_a_change_to_the_restart_policy_or_the_pod_template_resets_the_budget(change):
    st, pods = _budget_spent()
    changed = stage({**st.spec.wire(), **change}, st.status, generation=2)
    changed, plan = settle(changed, world(changed, pods))
    assert cond(changed.status, 'Stalled')['status'] == 'False'
    replica = changed.status['replicaStatuses'][0]
    assert 'budgetExhausted' not in replica and replica['recentRestarts'] == []


def test_a_scale_down_does_not_wait_out_the_video_jobs_of_a_fenced_replica():
    """spec.jobs: a fenced replica whose only work is video jobs is deleted at the next probe; stopped, the stage
    checkpoints each job and hands it to another replica (a long video never holds a drain). Any other request in
    flight still holds it."""
    from stage_operator.health import PodHealth
    from stage_operator.scaledown import fence

    st = stage({**CPU, 'replicas': 1, 'jobs': {'claimName': 'video-jobs'}})
    pods = [pod(st, i) for i in range(2)]
    t_fence = 1767225900.0
    first = reconcile(st, world(st, pods))
    assert [(p.name, p.body) for p in first.patch] == [('s-1', fence(t_fence))]
    apply_merge(pods[1]['metadata'], fence(t_fence)['metadata'])
    counts = {'queued': 0, 'in_progress': 2, 'completed': 5, 'failed': 0}

    def probed(running: int, here: int) -> dict:
        return {'pod-1': PodHealth('Healthy', t_fence + 5, answered=True, waiting=0, running=running,
                                   jobs={'here': here, **counts})}

    def removed(health) -> list[str]:
        return deleted(reconcile(st, dataclasses.replace(world(st, pods), now='2026-01-01T00:05:10Z', health=health)))

    assert removed(probed(running=2, here=1)) == []             # an image request runs beside the job: it waits
    assert removed(probed(running=1, here=1)) == ['s-1']        # the job alone: it hands off
    assert removed(probed(running=0, here=1)) == ['s-1']        # the job writes its MP4: it finishes on SIGTERM


def test_status_shows_the_video_jobs_by_status_and_each_replicas_runs():
    from stage_operator.health import PodHealth

    st = stage({**CPU, 'jobs': {'claimName': 'video-jobs'}})
    observed = world(st, [pod(st, 0), pod(st, 1)])
    counts = {'queued': 3, 'in_progress': 2, 'completed': 7, 'failed': 1}
    health = {'pod-0': PodHealth('Healthy', 1.0, answered=True, waiting=0, running=1, jobs={'here': 1, **counts}),
              'pod-1': PodHealth('Healthy', 2.0, answered=True, waiting=1, running=1,
                                 jobs={'here': 1, **counts, 'completed': 8})}     # its scan came later
    status = reconcile(st, dataclasses.replace(observed, health=health)).status
    assert status['jobs'] == {'queued': 3, 'inProgress': 2, 'completed': 7, 'failed': 1}   # one source: pod 0
    assert [r['jobs'] for r in status['replicaStatuses']] == [1, 1]
    silent = reconcile(stage({**CPU, 'jobs': {'claimName': 'video-jobs'}}, status=status),
                       dataclasses.replace(observed, health={})).status
    assert 'jobs' not in silent and 'replicaStatuses' in silent  # no probe: the last count stays (no patch of it)
    assert 'jobs' not in reconcile(st := stage(CPU), world(st, [pod(st, 0)])).status
