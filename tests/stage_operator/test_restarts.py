"""Table-driven cases for the fail-closed restart policy (pure: `restarts.decide`, and through `reconcile`)."""
from __future__ import annotations

import copy
from typing import Any

import pytest

from stage_operator.api.spec import RestartPolicy
from stage_operator.builders.children import build_configmap, build_service
from stage_operator.builders.disruption import build_pdb
from stage_operator.builders.networkpolicy import build_network_policy
from stage_operator.builders.pod import build_pod, template_hash
from stage_operator.clock import format_time, parse_time
from stage_operator.health import PodHealth
from stage_operator.observed import Observed, pod_view
from stage_operator.reconcile import reconcile
from stage_operator.restarts import decide, policy_digest, same_budget
from stage_operator.stage import parse_stage

T0 = '2026-01-01T00:00:00Z'
CPU = {'model': {'builtin': 'tiny-sd'}, 'replicas': 2, 'resources': {'gpusPerPod': 1, 'gpuResourceName': ''}}


def stage(spec: dict[str, Any], status: dict[str, Any] | None = None, generation: int = 1):
    return parse_stage({'metadata': {'name': 's', 'namespace': 'ns', 'uid': 'uid-1', 'generation': generation},
                        'spec': copy.deepcopy(spec), 'status': status or {}})


def pod(st, index: int, state: str = 'ready') -> dict[str, Any]:
    obj = build_pod(st, index)
    obj['metadata']['uid'] = f'pod-{index}'
    obj['status'] = failed(3, 'EngineDead: collective timed out') if state == 'failed' else STATES[state]
    return obj


def world(st, pods, now: str = '2026-01-01T00:05:00Z') -> Observed:
    return Observed(pods=list(pods), service=build_service(st), configmap=build_configmap(st),
                    pdb=build_pdb(st, st.spec.replicas),
                    network_policy=build_network_policy(st), now=now)


def cond(status: dict, kind: str) -> dict:
    return next(c for c in status['conditions'] if c['type'] == kind)

NOW = parse_time('2026-01-01T00:10:00Z')
POLICY = RestartPolicy(max_restarts=3, window_seconds=600, backoff_initial_seconds=10, backoff_max_seconds=25)
OTHER_POLICY = RestartPolicy(max_restarts=2, window_seconds=600, backoff_initial_seconds=10, backoff_max_seconds=25)


def at(seconds_ago: float) -> str:
    return format_time(NOW - seconds_ago, millis=True)


def failed(exit_code: int = 3, message: str = 'WorkerDied: worker rank 1 (pid 7) killed by signal 9 (SIGKILL)'):
    return {'phase': 'Failed', 'containerStatuses': [{'name': 'stage', 'state': {'terminated': {
        'exitCode': exit_code, 'reason': 'Error', 'message': message, 'finishedAt': T0}}}]}


STATES = {'ready': {'phase': 'Running', 'conditions': [{'type': 'Ready', 'status': 'True'}]},
          'starting': {'phase': 'Running', 'conditions': [{'type': 'Ready', 'status': 'False'}]},
          'pending': {'phase': 'Pending'}, 'failed': failed(),
          'invalid': failed(2, 'ConfigError: tp=3 does not divide 2')}
HEALTH = {'dead': PodHealth('Unhealthy', NOW - 1, 0, True, 'Engine is dead: worker rank 0 died'),
          'silent': PodHealth('Unreachable', NOW - 1, 3, True, 'connect refused'),
          'starting': PodHealth('Unreachable', NOW - 1, 5, False, 'connect refused'),
          'fine': PodHealth('Healthy', NOW - 1, 0, True, '', 'ready', 0, 1)}

# (case, pod state, probe, previous replica status, what changed since: None, 'template' or 'policy') ->
#  (fence?, recreate?, stalled reason, backoffUntil (seconds from now), lastFailure reason)
CASES = [
    ('healthy', 'ready', 'fine', {}, None, (False, False, None, None, None)),
    ('pending-never-restarted', 'pending', None, {}, None, (False, False, None, None, None)),
    ('starting-stage-not-failed', 'starting', 'starting', {}, None, (False, False, None, None, None)),
    ('failed-first-seen-backs-off', 'failed', None, {}, None, (True, False, None, 10, 'WorkerDied')),
    ('backoff-doubles', 'failed', None, {'recentRestarts': [at(100), at(50)]}, None,
     (True, False, None, 25, 'WorkerDied')),
    ('backoff-not-over', 'failed', None, {'backoffUntil': at(-3)}, None, (True, False, None, 3, 'WorkerDied')),
    ('backoff-over-recreates', 'failed', None, {'backoffUntil': at(0.5)}, None,
     (False, True, None, None, 'WorkerDied')),
    ('budget-exhausted', 'failed', None, {'recentRestarts': [at(300), at(200), at(100)]}, None,
     (True, False, 'RestartBudgetExhausted', None, 'WorkerDied')),
    ('old-restarts-leave-the-window', 'failed', None, {'recentRestarts': [at(900), at(800), at(100)]}, None,
     (True, False, None, 20, 'WorkerDied')),
    ('exhausted-is-sticky', 'failed', None, {'recentRestarts': [at(900)], 'budgetExhausted': True}, None,
     (True, False, 'RestartBudgetExhausted', None, 'WorkerDied')),
    ('template-change-resets-budget', 'failed', None,
     {'recentRestarts': [at(30), at(20), at(10)], 'budgetExhausted': True}, 'template',
     (True, False, None, 10, 'WorkerDied')),
    ('restart-policy-change-resets-budget', 'failed', None,
     {'recentRestarts': [at(30), at(20), at(10)], 'budgetExhausted': True}, 'policy',
     (True, False, None, 10, 'WorkerDied')),
    ('exit-2-stalls-at-once', 'invalid', None, {}, None, (True, False, 'InvalidConfiguration', None, 'ConfigError')),
    ('health-503', 'ready', 'dead', {}, None, (True, False, None, 10, 'Unhealthy')),
    ('probe-failures', 'ready', 'silent', {}, None, (True, False, None, 10, 'ProbeFailed')),
    ('fenced-pod-answering-again-still-restarts', 'fenced', 'fine',
     {'backoffUntil': at(0.1), 'lastFailure': {'reason': 'ProbeFailed', 'message': 'no answer'}}, None,
     (False, True, None, None, 'ProbeFailed')),
    ('unfenced-new-pod-is-not-blamed', 'ready', 'fine',
     {'backoffUntil': at(0.1), 'lastFailure': {'reason': 'ProbeFailed', 'message': 'no answer'}}, None,
     (False, False, None, None, 'ProbeFailed')),
]


@pytest.mark.parametrize('state, probe, previous, changed, expected', [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_restart_policy_table(state, probe, previous, changed, expected):
    st = stage(CPU)
    obj = pod(st, 0)
    obj['status'] = STATES['ready' if state == 'fenced' else state]
    if state == 'fenced':
        obj['metadata']['labels']['diffstage.io/serving'] = 'false'
    view = pod_view(obj)
    status = {'observedGeneration': 1, 'templateHash': 'old-hash' if changed == 'template' else template_hash(st),
              'restarts': {'total': 0, 'policyDigest': policy_digest(OTHER_POLICY if changed == 'policy' else POLICY)},
              'replicaStatuses': [{'index': 0, 'pod': 's-0', 'phase': 'Running', **previous}]}
    health = {view.uid: HEALTH[probe]} if probe else {}
    out = decide(POLICY, status, {0: view}, health, 3, template_hash(st), NOW)
    fence, recreate, stalled, backoff, reason = expected
    assert out.fence == (['s-0'] if fence else [])
    assert out.recreate == ([(0, 's-0')] if recreate else [])
    assert out.added == int(recreate)
    assert (out.stalled or (None,))[0] == stalled
    record = out.records[0]
    until = record.backoff_until
    assert (None if until is None else round(until - NOW, 3)) == backoff
    assert (record.last_failure or {}).get('reason') == reason
    if recreate:
        assert record.restarts == 1 and record.recent[-1] == NOW
    if stalled == 'RestartBudgetExhausted':
        assert record.exhausted and out.records[0].wire()['budgetExhausted'] is True


def test_failure_reason_and_message_come_from_the_termination_message():
    st = stage(CPU)
    obj = pod(st, 0)
    obj['status'] = failed()
    out = decide(POLICY, {}, {0: pod_view(obj)}, {}, 3, template_hash(st), NOW)
    assert out.records[0].last_failure == {'reason': 'WorkerDied', 'exitCode': 3, 'time': T0,
                                          'message': 'worker rank 1 (pid 7) killed by signal 9 (SIGKILL)'}
    assert [e[1] for e in out.events] == ['RestartBackoff']
    assert 'restarting in 10s (restart 1 of 3 within 600s)' in out.events[0][2]


def test_reconcile_recreates_after_backoff_and_counts_the_restart():
    st = stage({**CPU, 'restartPolicy': {'backoffInitialSeconds': 1, 'backoffMaxSeconds': 1}})
    pods = [pod(st, 0, 'failed'), pod(st, 1)]
    first = reconcile(st, world(st, pods, now='2026-01-01T00:05:00Z'))
    assert first.delete == [] and first.create == [] and first.requeue_after == pytest.approx(1.0)
    replica = first.status['replicaStatuses'][0]
    assert replica['backoffUntil'] == '2026-01-01T00:05:01.000Z' and replica['lastFailure']['reason'] == 'EngineDead'
    assert cond(first.status, 'Degraded')['status'] == 'True'
    assert [(e['type'], e['reason']) for e in first.events] == [('Warning', 'ReplicaFailed'),
                                                                ('Warning', 'RestartBackoff')]
    waited = stage(st.spec.wire(), status=first.status, generation=1)
    second = reconcile(waited, world(waited, pods, now='2026-01-01T00:05:01Z'))
    assert [(d.name, d.reason) for d in second.delete] == [('s-0', 'Restart')]
    assert [o['metadata']['name'] for o in second.create] == ['s-0']
    assert second.status['restarts'] == {'total': 1}
    assert second.status['replicaStatuses'][0]['restarts'] == 1
    assert 'RestartingReplica' in [e['reason'] for e in second.events]


def test_reconcile_stalls_on_exit_code_2_and_keeps_the_pod():
    st = stage(CPU)
    obj = pod(st, 0)
    obj['status'] = failed(2, 'ConfigError: tensor_parallel_size=3 does not divide num_gpus=2')
    plan = reconcile(st, world(st, [obj, pod(st, 1)]))
    stalled = cond(plan.status, 'Stalled')
    assert (stalled['status'], stalled['reason']) == ('True', 'InvalidConfiguration')
    assert 'tensor_parallel_size=3 does not divide num_gpus=2' in stalled['message']
    assert plan.status['phase'] == 'Stalled' and plan.delete == [] and plan.create == []
    assert plan.requeue_after is None
    assert ('Warning', 'InvalidConfiguration') in [(e['type'], e['reason']) for e in plan.events]


def test_the_budget_is_tied_to_the_pod_template_and_the_restart_policy_not_the_generation():
    """kubectl scale, an HPA's /scale, a spec.abort move the generation only: the budget stays (same_budget);
    a new template hash or restart policy resets it. decide() does not even see the generation."""
    st = stage(CPU)
    kept = {'observedGeneration': 1, 'templateHash': template_hash(st),
            'restarts': {'total': 3, 'policyDigest': policy_digest(POLICY)}}
    assert same_budget(kept, POLICY, template_hash(st))
    assert not same_budget(kept, POLICY, 'other-hash'), 'a new pod template'
    assert not same_budget({**kept, 'templateHash': None}, POLICY, template_hash(st)), 'after an invalid spec'
    assert not same_budget(kept, OTHER_POLICY, template_hash(st)), 'a new restart policy'
    assert same_budget({**kept, 'restarts': {'total': 3}}, POLICY, template_hash(st)), 'a status from before the digest'
    assert policy_digest(RestartPolicy()) == policy_digest(RestartPolicy(max_restarts=5)), 'the effective policy'
    spent = {'index': 0, 'pod': 's-0', 'phase': 'Failed', 'recentRestarts': [at(30), at(20), at(10)],
             'budgetExhausted': True}
    out = decide(POLICY, {**kept, 'replicaStatuses': [spent]}, {0: pod_view(pod(st, 0, 'failed'))}, {}, 3,
                 template_hash(st), NOW)
    assert (out.stalled or (None,))[0] == 'RestartBudgetExhausted' and out.recreate == [] and out.fence == ['s-0']
    assert out.records[0].exhausted and out.records[0].recent == (NOW - 30, NOW - 20, NOW - 10)
    assert out.policy_digest == policy_digest(POLICY), 'written to status.restarts.policyDigest'
