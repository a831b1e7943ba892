"""What the operator reports of model delivery (pure reconcile): the replica's phase while it starts
(Fetching, LoadingWeights, Warmup), an Event per phase and one with each phase's duration once Ready,
`status.model`, and a failed fetch (its init container's words) as lastFailure going through backoff."""
from __future__ import annotations

import copy

from stage_operator.builders.pod import build_pod
from stage_operator.health import PodHealth
from stage_operator.observed import Observed
from stage_operator.reconcile import reconcile
from stage_operator.stage import parse_stage

T0, T1 = '2026-01-01T00:00:00Z', '2026-01-01T00:05:00Z'
SHA = 'ab' * 32
SPEC = {'model': {'source': {'uri': {'url': 'https://m.example/tiny.tar.gz', 'sha256': SHA}},
                  'cache': {'hostPath': '/var/cache/m', 'maxBytes': 10 ** 9}},
        'replicas': 1, 'resources': {'gpusPerPod': 1, 'gpuResourceName': ''},
        'restartPolicy': {'backoffInitialSeconds': 10, 'backoffMaxSeconds': 60}}
FETCHED = {'name': 'fetch-model', 'state': {'terminated': {'exitCode': 0, 'reason': 'Completed',
                                                          'startedAt': '2026-01-01T00:04:00Z',
                                                          'finishedAt': '2026-01-01T00:04:03Z'}}}
STARTUP = {'phase': None, 'phases': {'loading_weights': 4.25, 'warmup': 0.5}, 'model_bytes': 733_000}


def stage(status=None):
    return parse_stage({'metadata': {'name': 's', 'namespace': 'ns', 'uid': 'u', 'generation': 1},
                        'spec': copy.deepcopy(SPEC), 'status': status or {}})


def pod(st, status):
    obj = build_pod(st, 0)
    obj['metadata']['uid'] = 'pod-0'
    obj['status'] = status
    return obj


def observe(st, status, health=None):
    return Observed(pods=[pod(st, status)], now=T1, health={'pod-0': health} if health else {})


def replica(plan):
    return plan.status['replicaStatuses'][0]


def events(plan, reason):
    return [e['message'] for e in plan.events if e['reason'] == reason]


def test_pending_with_fetch_model_running_is_fetching_and_says_so_once():
    st = stage({'observedGeneration': 1, 'replicaStatuses': [{'index': 0, 'pod': 's-0', 'phase': 'Pending'}]})
    status = {'phase': 'Pending', 'initContainerStatuses': [{'name': 'fetch-model', 'state': {'running': {}}}]}
    plan = reconcile(st, observe(st, status))
    assert replica(plan)['phase'] == 'Fetching'
    assert events(plan, 'ReplicaStarting') == ['s-0: Fetching']


def test_a_loading_stage_shows_its_phase():
    st = stage({'observedGeneration': 1, 'replicaStatuses': [{'index': 0, 'pod': 's-0', 'phase': 'LoadingWeights'}]})
    running = {'phase': 'Running', 'initContainerStatuses': [FETCHED],
               'conditions': [{'type': 'Ready', 'status': 'False'}]}
    warm = PodHealth('Healthy', 0, 0, True, '', 'starting', 0, 0, {'phase': 'warmup', 'phases': {'loading_weights': 4}})
    plan = reconcile(st, observe(st, running, warm))
    assert replica(plan)['phase'] == 'Warmup' and events(plan, 'ReplicaStarting') == ['s-0: Warmup']


def test_once_ready_the_phase_times_are_in_status_events_and_status_model():
    st = stage({'observedGeneration': 1, 'replicaStatuses': [{'index': 0, 'pod': 's-0', 'phase': 'Warmup'}]})
    ready = {'phase': 'Running', 'initContainerStatuses': [FETCHED], 'conditions': [{'type': 'Ready', 'status': 'True'}]}
    plan = reconcile(st, observe(st, ready, PodHealth('Healthy', 0, 0, True, '', 'ready', 0, 0, STARTUP)))
    r = replica(plan)
    assert r['phase'] == 'Running' and r['startupSeconds'] == {'fetching': 3.0, 'loadingWeights': 4.25, 'warmup': 0.5}
    assert events(plan, 'ReplicaReady') == ['s-0 ready after fetching 3.0 s, loading weights 4.2 s, warmup 0.5 s']
    assert plan.status['model'] == {'source': 'uri:https://m.example/tiny.tar.gz', 'digest': f'sha256:{SHA}',
                                    'sizeBytes': 733_000, 'loadSeconds': 4.75}


def test_status_model_keeps_what_was_measured_when_no_probe_has_answered_yet():
    before = {'source': 'uri:https://m.example/tiny.tar.gz', 'digest': f'sha256:{SHA}', 'sizeBytes': 5,
              'loadSeconds': 1.5}
    st = stage({'observedGeneration': 1, 'model': before})
    ready = {'phase': 'Running', 'conditions': [{'type': 'Ready', 'status': 'True'}]}
    plan = reconcile(st, observe(st, ready))
    assert plan.status is not None and 'model' not in plan.status, 'status.model unchanged: not in the patch'
    other = stage({'observedGeneration': 1, 'model': {**before, 'source': 'uri:https://elsewhere/m.tgz'}})
    patch = reconcile(other, observe(other, ready)).status['model']  # another source: its numbers are not ours
    assert patch == {'source': before['source'], 'sizeBytes': None, 'loadSeconds': None}


def test_a_wrong_checksum_is_the_last_failure_and_goes_through_backoff():
    st = stage()
    failed = {'phase': 'Failed', 'initContainerStatuses': [{'name': 'fetch-model', 'state': {'terminated': {
        'exitCode': 4, 'reason': 'Error', 'finishedAt': T0,
        'message': f'ChecksumMismatch: https://m.example/tiny.tar.gz: sha256 of the 9-byte download is {"0" * 64}, '
                   f'but --sha256 (spec.model.source.uri.sha256) is {SHA}'}}}]}
    plan = reconcile(st, observe(st, failed))
    r = replica(plan)
    assert r['lastFailure']['reason'] == 'ChecksumMismatch' and r['lastFailure']['exitCode'] == 4
    assert SHA in r['lastFailure']['message'] and 'backoffUntil' in r
    assert any('ChecksumMismatch (exit code 4)' in m and 'restarting in 10s' in m
               for m in events(plan, 'RestartBackoff')), plan.events
    assert plan.status['phase'] == 'Degraded'


def test_a_startup_timeout_is_the_last_failure_with_the_stages_words():
    st = stage()
    failed = {'phase': 'Failed', 'initContainerStatuses': [FETCHED], 'containerStatuses': [{'name': 'stage',
              'state': {'terminated': {'exitCode': 1, 'reason': 'Error', 'finishedAt': T0, 'message':
                        'StartupTimeout: not ready within the startup budget of 5 s (--startup-timeout, '
                        'spec.startupTimeoutSeconds): warmup for 2.0 s (loading weights took 3.0 s)'}}}]}
    r = replica(reconcile(st, observe(st, failed)))
    assert r['lastFailure']['reason'] == 'StartupTimeout' and 'warmup for 2.0 s' in r['lastFailure']['message']
