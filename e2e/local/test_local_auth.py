"""Tier 4, API keys: a DiffusionStage with `spec.auth.secretRef` on the embedded local cluster (the emulated API,
the operator as a real process, the pod as real local processes). The operator mounts the Secret as a `secret`
volume; the local kubelet fills it from the API.

One stage, in the order a newcomer meets it: applied before its Secret exists, the pod waits as on a real
cluster (not started, a FailedMount Event naming the Secret, the runner unharmed); the Secret applied with
`stringData` (as a manifest in Git holds it), the stage becomes Ready; then through its Service with the official
`openai` SDK: no key and a wrong key are `openai.AuthenticationError` (401), the right key gets an image.
Cheap on purpose: one replica, one rank, two steps.
"""
from __future__ import annotations

import base64
import io
import sys

import httpx
import openai
import pytest
import yaml
from PIL import Image

from e2e import scenario
from e2e.local.cluster import LocalCluster
from e2e.local.kubectl import KUBECTL, Kubectl, KubectlDriver

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith('linux'),
                       reason='the local pod runner gives each pod a 127.x.y.z address and reads /proc: Linux only'),
    pytest.mark.timeout(300),
]
NAME, SECRET, KEY = 'keyed', 'stage-keys', 'sk-local-e2e-0123456789'
STEPS = {'num_inference_steps': 2, 'seed': 1}


@pytest.fixture(scope='module')
def cluster(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp('auth-cluster')) as local:
        yield local
    assert local.operator.returncode == 0, local.operator_log[-3000:]
    assert 'Traceback' not in local.operator_log, local.operator_log[-5000:]
    assert not local.runner.errors, local.runner.errors


@pytest.fixture(scope='module')
def kubectl(cluster) -> Kubectl | None:
    return Kubectl(cluster.kubeconfig) if KUBECTL is not None else None


def apply_secret(cluster, kubectl: Kubectl | None, secret: dict) -> None:
    if kubectl is not None:
        kubectl('apply', '-f', '-', input=yaml.safe_dump(secret))
    else:
        response = cluster.api.post('/api/v1/namespaces/default/secrets', json=secret)
        assert response.status_code == 201, response.text


def pod_events(cluster, pod: str) -> list[str]:
    events = cluster.api.get('/api/v1/namespaces/default/events',
                             params={'fieldSelector': f'involvedObject.name={pod}'}).json()['items']
    return [f'{e["reason"]}: {e["message"]}' for e in events]


def test_a_stage_with_auth_waits_for_its_secret_then_serves_only_the_right_key(cluster, kubectl):
    hands = KubectlDriver(cluster, kubectl) if kubectl is not None else cluster
    manifest = scenario.with_spec(scenario.sample(), replicas=1, parallel={},
                                  resources={'gpusPerPod': 1, 'gpuResourceName': ''},
                                  auth={'secretRef': {'name': SECRET}})
    manifest['metadata']['name'] = NAME
    try:
        # step 1: no Secret yet: the pod is created and waits, and says why, as a kubelet says it
        hands.apply(manifest)
        pod = scenario.wait_for(lambda: next((p['metadata']['name'] for p in cluster.pods(NAME)), None), 60,
                                f'the pod of {NAME}', lambda: scenario.status(cluster, NAME))
        why = f'MountVolume.SetUp failed for volume "api-keys" : secret "{SECRET}" not found'
        scenario.wait_for(lambda: f'FailedMount: {why}' in pod_events(cluster, pod), 60, 'the FailedMount Event',
                          lambda: pod_events(cluster, pod))
        status = cluster.pods(NAME)[0]['status']
        assert status['phase'] == 'Pending' and not cluster.runner.errors, (status, cluster.runner.errors)
        assert {s['state']['waiting']['reason'] for s in status['initContainerStatuses']} == {'PodInitializing'}
        assert not scenario.is_ready(cluster, NAME, 1)
        if kubectl is not None:
            events = kubectl('describe', 'pod', pod).stdout.split('Events:')[1].splitlines()
            row = next((line for line in events if 'FailedMount' in line), '')
            assert row.split()[:2] == ['Warning', 'FailedMount'] and 'kubelet' in row and row.endswith(why), events
            assert kubectl('get', 'pod', pod).stdout.splitlines()[1].split()[1:3] == ['0/1', 'Init:0/1']
        # step 2: the Secret, as a manifest holds it: the same pod starts, the stage becomes Ready
        apply_secret(cluster, kubectl, {'apiVersion': 'v1', 'kind': 'Secret', 'metadata': {'name': SECRET},
                                        'stringData': {'api-keys': f'{KEY}\n'}})
        scenario.wait_ready(cluster, NAME, 1, timeout=180)
        assert [p['metadata']['name'] for p in cluster.pods(NAME)] == [pod], 'the waiting pod itself started'
        # step 3: the Service with the official SDK: 401 without the key or with another, an image with it
        url = scenario.wait_for(lambda: cluster.service_url(NAME), 30, f'an endpoint behind Service {NAME}')
        no_key = {'Authorization': openai.omit}  # the SDK wants a key: this request goes without the header
        for key, headers, why in (('unused', no_key, 'no API key'), ('sk-wrong', {}, 'a wrong API key')):
            with openai.OpenAI(base_url=f'{url}/v1', api_key=key, max_retries=0, timeout=60) as client:
                with pytest.raises(openai.AuthenticationError) as refused:
                    client.images.generate(prompt='a lighthouse', size='64x64', extra_body=STEPS,
                                           extra_headers=headers)
            assert refused.value.status_code == 401 and why in str(refused.value), refused.value
        with openai.OpenAI(base_url=f'{url}/v1', api_key=KEY, max_retries=0, timeout=120) as client:
            result = client.images.generate(prompt='a lighthouse', size='64x64', response_format='b64_json',
                                            extra_body=STEPS)
        image = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json)))
        assert (image.format, image.size) == ('PNG', (64, 64))
        assert httpx.get(f'{url}/health', timeout=10).status_code == 200, 'the probes stay open'
        # step 4: the deletion drains with the key too (regression: the operator dropped it once the stage was
        # being deleted, so its load probes got 401 and every deletion waited for drainTimeoutSeconds)
        scenario.delete(hands, NAME, timeout=120)
        assert f'delete Pod/{pod} (DrainTimeout)' not in cluster.operator_log, cluster.operator_log[-3000:]
    finally:
        if cluster.stage(NAME) is not None:
            scenario.delete(hands, NAME, timeout=120)
        cluster.api.delete(f'/api/v1/namespaces/default/secrets/{SECRET}')
