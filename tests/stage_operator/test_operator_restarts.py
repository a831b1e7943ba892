"""Fail-closed restarts end to end: the real operator (kopf, in a thread) against the emulated API, pods played
by a real `stage-runtime serve` process (or a stand-in that hangs) at their own pod IPs, the test as kubelet."""
from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from stage_process import StageProcess
from support.live_pods import StandIn, events, map_pod, pod_address, pod_uid, replica, watch_until
from support.operator_harness import Cluster, manifest, operator, settle, wait_for

ONE_RANK = {'parallel': {}, 'resources': {'gpusPerPod': 1, 'gpuResourceName': ''}}
FAST = {'restartPolicy': {'maxRestarts': 2, 'windowSeconds': 600, 'backoffInitialSeconds': 1, 'backoffMaxSeconds': 1},
        'healthCheck': {'periodSeconds': 0.5, 'timeoutSeconds': 1, 'failureThreshold': 3}}
MP_CFG2 = ['--device', 'cpu', '--executor', 'mp', '--cfg-parallel-size', '2']
BACKOFF = 6


@pytest.fixture
def cluster(kube_emulator, kubeconfig):
    c = Cluster(kube_emulator)
    yield c
    c.close()


def metric(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY
    return REGISTRY.get_sample_value(name, labels) or 0.0


def pod_creates(emulator) -> int:
    return sum(1 for m in emulator.mutations if m[:2] == ('create', 'pods'))


def test_killed_worker_restarts_after_backoff_then_the_budget_stalls(cluster, kube_emulator, tiny_sd_path, tmp_path):
    term = tmp_path / 'termination-log'
    stage = StageProcess(['--model', tiny_sd_path, *MP_CFG2, *pod_address()[1]], tmp_path / 'stage.log',
                         termination_log=term)
    restarts_before = metric('diffstage_operator_restarts_total')
    try:
        stage.start()
        with operator(kube_emulator):
            # Backoff 6 s: the probe may see /health 503 as soon as the worker dies and start the backoff; the
            # stage takes ~1 s to exit (more on a loaded machine), and the test (kubelet) must mark the pod Failed
            # before the replacement exists, whatever the machine's speed.
            cluster.apply(manifest('w', replicas=1, parallel={'cfgParallelSize': 2},
                                   resources={'gpusPerPod': 2, 'gpuResourceName': ''}, **{**FAST, 'restartPolicy': {
                                       **FAST['restartPolicy'], 'backoffInitialSeconds': BACKOFF,
                                       'backoffMaxSeconds': BACKOFF}}))
            wait_for(lambda: 'w-0' in cluster.pods('w'), what='the pod')
            map_pod(cluster, 'w-0', stage.http_url)
            wait_for(lambda: replica(cluster, 'w').get('health') == 'Healthy', what='probed healthy')
            assert replica(cluster, 'w')['running'] == 0 and replica(cluster, 'w')['waiting'] == 0
            first_uid = pod_uid(cluster, 'w', 'w-0')
            worker = httpx.get(f'{stage.http_url}/v1/stats', timeout=5).json()['workers'][-1]
            stage.track()
            killed_at = time.monotonic()
            os.kill(worker['pid'], signal.SIGKILL)
            assert stage.wait(60) == 3, stage.log[-2000:]
            exit_s = time.monotonic() - killed_at
            message = term.read_text()
            assert message.startswith('WorkerDied: '), message
            failed_at = time.monotonic()
            cluster.kubelet_failed('w-0', 3, message)
            recreated_at = watch_until(lambda: pod_uid(cluster, 'w', 'w-0') not in (None, first_uid), 20,
                                       'the replacement pod')
            reaction = recreated_at - failed_at
            assert reaction <= BACKOFF + 1, f'recreated {reaction:.2f}s after the failure (backoff {BACKOFF}s + 1s)'
            wait_for(lambda: cluster.status('w').get('restarts', {}).get('total') == 1, what='restarts.total 1')
            failure = replica(cluster, 'w')['lastFailure']
            assert failure['reason'] == 'WorkerDied' and failure['exitCode'] == 3
            assert f"pid {worker['pid']}" in failure['message'] and 'SIGKILL' in failure['message']
            wait_for(lambda: events(kube_emulator, 'w', 'RestartBackoff')  # posted after the status write
                     and events(kube_emulator, 'w', 'RestartingReplica'), what='the restart Events')
            new = cluster.pods('w')['w-0']['metadata']['labels']
            assert new['diffstage.io/serving'] == 'true', 'the replacement serves again'

            # The replacement fails too: restart 2; the third failure exhausts the budget (maxRestarts 2).
            for attempt in (2, 3):
                uid = pod_uid(cluster, 'w', 'w-0')
                cluster.kubelet_failed('w-0', 3, f'WorkerDied: worker rank 1 (pid {100 + attempt}) killed by signal 9')
                if attempt == 2:
                    wait_for(lambda u=uid: pod_uid(cluster, 'w', 'w-0') not in (None, u), BACKOFF + 30, what='restart 2')
            stalled = wait_for(lambda: cluster.condition('w', 'Stalled').get('status') == 'True'
                               and cluster.condition('w', 'Stalled'), 10, what='Stalled')
            assert stalled['reason'] == 'RestartBudgetExhausted', stalled
            assert 'the failed pod is kept' in stalled['message']
            status = cluster.status('w')
            assert status['phase'] == 'Stalled' and status['restarts']['total'] == 2
            assert metric('diffstage_operator_restarts_total') == restarts_before + 2
            kept = cluster.pods('w')['w-0']
            assert kept['status']['phase'] == 'Failed' and kept['metadata']['labels']['diffstage.io/serving'] == 'false'
            creates = pod_creates(kube_emulator)
            settle(past=BACKOFF + 1)  # two reconciles after the backoff would have restarted the pod
            assert pod_uid(cluster, 'w', 'w-0') == kept['metadata']['uid'] and pod_creates(kube_emulator) == creates
            assert events(kube_emulator, 'w', 'RestartBudgetExhausted')

            # A spec change resets the budget: the kept pod is replaced.
            cluster.patch_spec('w', {'restartPolicy': {'maxRestarts': 3}})
            wait_for(lambda: pod_uid(cluster, 'w', 'w-0') not in (None, kept['metadata']['uid']), BACKOFF + 30,
                     what='a restart after the spec change')
            wait_for(lambda: cluster.condition('w', 'Stalled').get('status') == 'False', what='no longer Stalled')
    finally:
        stage.kill()
    stage.assert_no_leaks()
    print(f'\nreaction: pod Failed -> replacement created in {reaction:.3f}s (backoff {BACKOFF}s, started by the probe); '
          f'the stage exited {exit_s:.3f}s after the SIGKILL')


def test_exit_code_2_stalls_at_once_with_the_stage_message(cluster, kube_emulator, tiny_sd_path, tmp_path):
    term = tmp_path / 'termination-log'
    stage = StageProcess(['--model', tiny_sd_path, '--device', 'cpu', '--cfg-parallel-size', '3'],
                         tmp_path / 'stage.log', termination_log=term)
    with operator(kube_emulator):
        cluster.apply(manifest('bad', replicas=1, **ONE_RANK, **FAST))
        wait_for(lambda: 'bad-0' in cluster.pods('bad'), what='the pod')
        stage.start(wait_ready=False)  # the container starts, reads its configuration, gives up
        assert stage.wait(60) == 2, stage.log[-2000:]
        message = term.read_text()
        assert message.startswith('ConfigError: ')
        uid = pod_uid(cluster, 'bad', 'bad-0')
        cluster.kubelet_failed('bad-0', 2, message)
        stalled = wait_for(lambda: cluster.condition('bad', 'Stalled').get('status') == 'True'
                           and cluster.condition('bad', 'Stalled'), 10, what='Stalled')
        assert stalled['reason'] == 'InvalidConfiguration'
        assert message.split(': ', 1)[1].strip() in stalled['message']
        assert cluster.status('bad')['phase'] == 'Stalled'
        assert 'backoffUntil' not in replica(cluster, 'bad')
        settle(past=2)  # past the backoff, two reconciles: never restarted
        assert pod_uid(cluster, 'bad', 'bad-0') == uid and cluster.status('bad')['restarts']['total'] == 0
    stage.kill()


def test_a_hung_stage_answering_503_is_fenced_and_replaced(cluster, kube_emulator):
    """A hung stage is a fault a real one cannot be made to show: the stand-in plays it, saying only what the
    stage's own /openapi.json allows (tests/support/test_live_pods.py)."""
    unhealthy_before = metric('diffstage_operator_probe_failures_total', kind='unhealthy')
    with StandIn() as hung, operator(kube_emulator):
        cluster.apply(manifest('h', replicas=1, **ONE_RANK, **FAST))
        wait_for(lambda: 'h-0' in cluster.pods('h'), what='the pod')
        map_pod(cluster, 'h-0', hung.url)
        wait_for(lambda: replica(cluster, 'h').get('health') == 'Healthy', what='healthy first')
        uid = pod_uid(cluster, 'h', 'h-0')
        hung.dead = 'worker rank 0 stopped answering (collective timed out)'
        wait_for(lambda: replica(cluster, 'h').get('health') == 'Unhealthy', 10, what='seen unhealthy')
        failure = replica(cluster, 'h')['lastFailure']
        assert failure['reason'] == 'Unhealthy' and 'collective timed out' in failure['message']
        wait_for(lambda: pod_uid(cluster, 'h', 'h-0') not in (None, uid), 10, what='the replacement')
        wait_for(lambda: cluster.status('h')['restarts']['total'] == 1, what='the restart counted')  # pods first
        fenced = [m for m in kube_emulator.mutations if m[:2] == ('patch', 'pods') and m[3] == 'h-0']
        assert fenced, 'the hung pod was taken out of the Service before it was replaced'
        assert metric('diffstage_operator_probe_failures_total', kind='unhealthy') > unhealthy_before


def test_reaction_from_pod_failed_to_the_replacement_is_within_backoff_plus_1s(cluster, kube_emulator):
    """The pod-Failed watch event → the recreate call, with nothing else in the way (no probe started the
    backoff earlier): bench/operator_restart.py measures the same on the operator process."""
    with operator(kube_emulator):
        cluster.apply(manifest('rt', replicas=1, **ONE_RANK, restartPolicy={
            'maxRestarts': 5, 'windowSeconds': 600, 'backoffInitialSeconds': 1, 'backoffMaxSeconds': 1}))
        wait_for(lambda: 'rt-0' in cluster.pods('rt'), what='the pod')
        reactions = []
        for attempt in range(3):
            cluster.kubelet_ready('rt-0')
            uid = pod_uid(cluster, 'rt', 'rt-0')
            failed_at = time.monotonic()
            cluster.kubelet_failed('rt-0', 3, f'WorkerDied: worker rank 1 (pid {attempt}) killed by signal 9')
            reactions.append(watch_until(lambda u=uid: pod_uid(cluster, 'rt', 'rt-0') not in (None, u), 10,
                                         'the replacement') - failed_at)
        assert all(1.0 - 0.05 <= r <= 1 + 1 for r in reactions), reactions
        wait_for(lambda: cluster.status('rt').get('restarts', {}).get('total') == 3, what='3 restarts')
