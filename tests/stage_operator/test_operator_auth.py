"""spec.auth.secretRef against a live stage that requires an API key (`--api-key-file`): the real operator
(kopf, in a thread) reads the key from the Secret through the API and sends it on its own /v1/stats and
/v1/abort calls; /health stays open. The test plays kubelet (the pod's container is the live stage)."""
from __future__ import annotations

import base64

import httpx
import pytest
from stage_process import StageProcess
from support.live_pods import Generation, map_pod, pod_address, replica, wait_in_flight
from support.operator_harness import Cluster, manifest, operator, settle, wait_for

KEY = 'sk-stage-0123456789'
ONE_RANK = {'replicas': 1, 'parallel': {}, 'resources': {'gpusPerPod': 1, 'gpuResourceName': ''},
            'engine': {'executionMode': 'step', 'maxNumSeqs': 4},
            'healthCheck': {'periodSeconds': 0.25, 'timeoutSeconds': 1, 'failureThreshold': 3}}


@pytest.fixture(scope='module')
def keyed(tiny_sd_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp('keyed-stage')
    (folder / 'keys').write_text(f'# one a line\n{KEY}\nsk-other\n')
    stage = StageProcess(['--model', tiny_sd_path, '--device', 'cpu', '--executor', 'uni', '--execution-mode', 'step',
                          '--max-num-seqs', '4', '--api-key-file', str(folder / 'keys'), *pod_address()[1]],
                         folder / 'stage.log')
    try:
        stage.start()
        yield stage
        assert stage.stop() == 0, stage.log[-2000:]
        stage.assert_no_leaks()
    finally:
        stage.kill()


@pytest.fixture
def cluster(kube_emulator, kubeconfig, keyed):
    c = Cluster(kube_emulator)
    yield c
    c.close()


def secret(name: str, text: str) -> dict:
    return {'metadata': {'name': name}, 'type': 'Opaque',
            'data': {'api-keys': base64.b64encode(text.encode()).decode()}}


def test_the_operator_reads_the_key_and_uses_it_for_stats_and_abort(cluster, kube_emulator, keyed):
    assert httpx.get(f'{keyed.http_url}/v1/stats', timeout=5).status_code == 401, 'the stage wants the key'
    assert httpx.get(f'{keyed.http_url}/health', timeout=5).status_code == 200, '/health stays open'
    kube_emulator.seed('secrets', secret('stage-keys', f'{KEY}\n'))
    with operator(kube_emulator):
        cluster.apply(manifest('auth', auth={'secretRef': {'name': 'stage-keys'}}, **ONE_RANK))
        pod = wait_for(lambda: cluster.pods('auth').get('auth-0'), what='the pod')
        assert '--api-key-file' in pod['spec']['containers'][0]['command']
        assert {'name': 'api-keys', 'secret': {'secretName': 'stage-keys', 'defaultMode': 0o444,
                                               'items': [{'key': 'api-keys', 'path': 'api-keys'}]}} \
            in pod['spec']['volumes']
        map_pod(cluster, 'auth-0', keyed.http_url)
        # the load is in status only when /v1/stats answered 200: the operator sent the key
        wait_for(lambda: 'running' in replica(cluster, 'auth', 0), what='the load read with the key')
        bearer = {'Authorization': f'Bearer {KEY}'}
        calls = [Generation(keyed.http_url, 'keyed-long', 600, headers=bearer)]
        wait_in_flight(keyed.http_url, 1, calls, headers=bearer)
        cluster.patch_spec('auth', {'abort': {'id': 'a1', 'requestIds': ['keyed-long']}})
        result = wait_for(lambda: cluster.status('auth').get('abort'), what='status.abort')
        assert result['aborted'] == ['keyed-long'] and result['unreachable'] == [], result
        calls[0].join(30)
        assert calls[0].status == 409, (calls[0].status, calls[0].body)


def test_a_wrong_key_leaves_the_pod_healthy_without_load_and_restarts_nothing(cluster, kube_emulator, keyed):
    """A 401 is a configuration problem to report (the operator's log), never a reason to restart a pod that
    answers /health."""
    kube_emulator.seed('secrets', secret('wrong-keys', 'sk-not-this-one\n'))
    with operator(kube_emulator):
        cluster.apply(manifest('wrong', auth={'secretRef': {'name': 'wrong-keys'}}, **ONE_RANK))
        wait_for(lambda: cluster.pods('wrong').get('wrong-0'), what='the pod')
        map_pod(cluster, 'wrong-0', keyed.http_url)
        wait_for(lambda: replica(cluster, 'wrong', 0).get('health') == 'Healthy', what='probed')
        settle(past=3.0)  # a dozen probe periods, then reconciles: still healthy, no load known, nothing restarted
        r = replica(cluster, 'wrong', 0)
        assert r.get('health') == 'Healthy' and 'running' not in r, r
        assert cluster.status('wrong')['restarts']['total'] == 0 and cluster.pods('wrong')['wrong-0']['metadata'][
            'labels']['diffstage.io/serving'] == 'true'
