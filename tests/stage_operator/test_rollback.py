"""Revisions, automatic rollback, evictions and the PodDisruptionBudget, through the pure `reconcile`."""
from __future__ import annotations

import copy
import dataclasses

import pytest

from e2e.local import kubelet
from stage_operator.builders.children import build_configmap, build_service
from stage_operator.builders.disruption import build_pdb
from stage_operator.builders.networkpolicy import build_network_policy
from stage_operator.builders.pod import build_pod, template_hash
from stage_operator.clock import parse_time
from stage_operator.observed import Observed
from stage_operator.reconcile import reconcile
from stage_operator.stage import parse_stage

from support.reconcile_world import apply_merge

from .test_reconcile import cond

CPU = {'model': {'builtin': 'tiny-sd'}, 'replicas': 2, 'resources': {'gpusPerPod': 1, 'gpuResourceName': ''}}
BAD = {**CPU, 'engine': {'extraArgs': ['--bad-flag']}}
T0, T1, T2 = '2026-01-01T00:00:00Z', '2026-01-01T00:05:00Z', '2026-01-01T00:06:00Z'


def stage(spec, status=None, generation: int = 1):
    return parse_stage({'metadata': {'name': 's', 'namespace': 'ns', 'uid': 'uid-1', 'generation': generation},
                        'spec': copy.deepcopy(spec), 'status': copy.deepcopy(status or {})})


def pod(st, index: int, status: dict) -> dict:
    obj = build_pod(st, index)
    obj['metadata']['uid'] = f'{template_hash(st)}-{index}'
    obj['status'] = status
    return obj


READY = kubelet.running('stage', True, '127.100.0.9', started=T0)  # at a pod IP: it can hold work
EXIT_2 = kubelet.failed('stage', 2, 'ConfigError: unknown engine flag --bad-flag', at=T1)


def world(template, pods, now: str, replicas: int = 2) -> Observed:
    return Observed(pods=pods, service=build_service(template), configmap=build_configmap(template),
                    pdb=build_pdb(template, replicas), network_policy=build_network_policy(template), now=now)


def after(st, plan):
    status = copy.deepcopy(dict(st.status))
    apply_merge(status, plan.status or {})
    return status


def ready_stage():
    """Two replicas of CPU, Ready: the stable revision."""
    st = stage(CPU)
    plan = reconcile(st, world(st, [pod(st, 0, READY), pod(st, 1, READY)], T0))
    return after(st, plan)


def test_a_ready_revision_becomes_the_stable_one_with_its_spec():
    status = ready_stage()
    st = stage(CPU)
    rollout = status['rollout']
    assert rollout['stableRevision'] == rollout['currentRevision'] == template_hash(st)
    assert rollout['stableSpec'] == st.spec.wire()
    assert [r['revision'] for r in rollout['revisions']] == [template_hash(st)]
    assert rollout['revisions'][0]['readyTime'] == T0 and len(rollout['revisions'][0]['digest']) == 16
    again = reconcile(stage(CPU, status), world(st, [pod(st, 0, READY), pod(st, 1, READY)], T1))
    assert again.writes == 0, again.summary()


def test_a_revision_that_exits_2_is_rolled_back_without_counting_a_restart():
    good, status = stage(CPU), ready_stage()
    bad = stage(BAD, status, generation=2)
    # the rollout drained s-1 (maxUnavailable 1); its replacement, of the new revision, exited 2
    plan = reconcile(bad, world(good, [pod(good, 0, READY), pod(bad, 1, EXIT_2)], T1))
    assert [(d.name, d.reason) for d in plan.delete] == [('s-1', 'Outdated')]  # the failed pod leaves (no work)
    assert plan.create == [] and after(bad, plan)['restarts']['total'] == 0
    degraded = cond(plan.status, 'Degraded')
    assert (degraded['status'], degraded['reason']) == ('True', 'RolloutFailed')
    assert 's-1: ConfigError (exit code 2): unknown engine flag --bad-flag' in degraded['message']  # its words
    assert f"serving revision {template_hash(good)} again" in degraded['message']
    assert cond(plan.status, 'Stalled')['status'] == 'False' and plan.status['phase'] == 'Degraded'
    configmap = [p for p in plan.patch if p.kind == 'ConfigMap']
    assert configmap == [] or configmap[0].body['data'] == build_configmap(good)['data']
    rollout = after(bad, plan)['rollout']
    assert rollout['currentRevision'] == template_hash(good) and rollout['failedRevision']['revision'] == \
        template_hash(bad)
    assert [e['reason'] for e in plan.events if e['reason'] in ('RolledBack', 'RolloutFailed')] == [
        'RolloutFailed', 'RolledBack']
    # next round: the replica comes back with the stable revision's pod (the old config), still no restart
    status = after(bad, plan)
    again = reconcile(stage(BAD, status, generation=2), world(good, [pod(good, 0, READY)], T2))
    assert [o['metadata']['name'] for o in again.create] == ['s-1']
    assert again.create[0]['metadata']['labels']['diffstage.io/template-hash'] == template_hash(good)
    assert again.create[0]['spec'] == build_pod(good, 1)['spec']
    status = after(stage(BAD, status, generation=2), again)
    served = reconcile(stage(BAD, status, generation=2), world(good, [pod(good, 0, READY), pod(good, 1, READY)], T2))
    assert served.create == [] and served.delete == [] and served.status is not None
    status = after(stage(BAD, status, generation=2), served)
    assert status['phase'] == 'Degraded' and cond(status, 'Progressing')['reason'] == 'RolloutFailed'
    assert status['readyReplicas'] == 2 and status['restarts']['total'] == 0
    settled = reconcile(stage(BAD, status, generation=2),
                        world(good, [pod(good, 0, READY), pod(good, 1, READY)], T2))
    assert settled.writes == 0, settled.summary()


def test_a_later_spec_change_rolls_forward_again():
    good, status = stage(CPU), ready_stage()
    bad = stage(BAD, status, generation=2)
    status = after(bad, reconcile(bad, world(good, [pod(good, 0, READY), pod(bad, 1, EXIT_2)], T1)))
    fixed = stage({**CPU, 'engine': {'maxNumSeqs': 2}}, status, generation=3)
    plan = reconcile(fixed, world(good, [pod(good, 0, READY), pod(good, 1, READY)], T2))
    assert plan.status['rollout']['currentRevision'] == template_hash(fixed)
    assert [p.name for p in plan.patch if p.kind == 'Pod'] == ['s-0']  # drained: the rollout goes on
    assert cond(plan.status, 'Degraded')['status'] == 'False'


def test_no_new_replica_ready_within_the_progress_deadline_rolls_back():
    good, status = stage(CPU), ready_stage()
    slow = stage({**BAD, 'rollout': {'progressDeadlineSeconds': 30}}, status, generation=2)
    starting = kubelet.running('stage', False, '127.100.0.9', started=T1)
    first = reconcile(slow, world(good, [pod(good, 0, READY), pod(slow, 1, starting)], T1))
    assert first.status['rollout']['progressTime'] == T1 and first.requeue_after == pytest.approx(30)
    status = after(slow, first)
    late = reconcile(stage(slow.spec.wire(), status, generation=2),
                     world(good, [pod(good, 0, READY), pod(slow, 1, starting)], '2026-01-01T00:05:31Z'))
    degraded = cond(late.status, 'Degraded')
    assert degraded['reason'] == 'RolloutFailed' and 'progressDeadlineSeconds=30' in degraded['message']
    assert [p.name for p in late.patch if p.kind == 'Pod'] == ['s-1']  # the new pod leaves through the drain


def test_the_first_revision_has_nothing_to_roll_back_to():
    st = stage(BAD)
    plan = reconcile(st, world(st, [pod(st, 0, EXIT_2), pod(st, 1, READY)], T1))
    assert cond(plan.status, 'Stalled')['reason'] == 'InvalidConfiguration'  # the restart policy's verdict


def test_an_evicted_pod_is_replaced_at_once_and_not_counted():
    st = stage(CPU, ready_stage())
    evicted = {'phase': 'Failed', 'reason': 'Evicted', 'message': 'The node was low on resource: memory.',
               'conditions': [{'type': 'DisruptionTarget', 'status': 'True', 'reason': 'TerminationByKubelet',
                               'lastTransitionTime': T1}]}
    plan = reconcile(st, world(st, [pod(st, 0, evicted), pod(st, 1, READY)], T1))
    assert [(d.name, d.reason) for d in plan.delete] == [('s-0', 'Restart')]
    assert [o['metadata']['name'] for o in plan.create] == ['s-0'] and plan.requeue_after is None  # no backoff
    assert after(st, plan)['restarts']['total'] == 0
    replica = plan.status['replicaStatuses'][0]
    assert replica['restarts'] == 0 and replica['lastFailure']['reason'] == 'Evicted'
    assert replica['lastFailure']['message'] == 'The node was low on resource: memory.'
    assert 'ReplicaEvicted' in [e['reason'] for e in plan.events]


@pytest.mark.parametrize('replicas, asked, budget', [(2, None, 1), (3, None, 1), (1, None, None), (0, None, None),
                                                     (1, 1, 1), (4, 2, 2), (3, 0, 0)])
def test_the_disruption_budget(replicas, asked, budget):
    spec = {**CPU, 'replicas': replicas, **({'disruption': {'maxUnavailable': asked}} if asked is not None else {})}
    st = stage(spec)
    pdb = build_pdb(st, replicas)
    if budget is None:
        assert pdb is None
        return
    assert pdb['apiVersion'] == 'policy/v1' and pdb['metadata']['name'] == 's'
    assert pdb['metadata']['ownerReferences'][0]['uid'] == 'uid-1'  # garbage-collected with the stage
    assert pdb['spec'] == {'maxUnavailable': budget, 'unhealthyPodEvictionPolicy': 'AlwaysAllow',
                           'selector': {'matchLabels': {'diffstage.io/stage': 's', 'diffstage.io/serving': 'true'}}}


def test_the_budget_is_created_kept_and_removed_with_the_replica_count():
    st = stage(CPU)
    pods = [pod(st, 0, READY), pod(st, 1, READY)]
    missing = dataclasses.replace(world(st, pods, T1), pdb=None)
    assert [o['kind'] for o in reconcile(st, missing).create] == ['PodDisruptionBudget']
    one = stage({**CPU, 'replicas': 1})
    plan = reconcile(one, world(st, pods, T1))
    assert [(d.kind, d.name) for d in plan.delete if d.kind != 'Pod'] == [('PodDisruptionBudget', 's')]
    assert parse_time(T1) > 0
