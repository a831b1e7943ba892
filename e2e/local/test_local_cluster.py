"""Tier 4: the whole system on the embedded local cluster (docs/testing.md). The emulated API, the operator as a
real process, every pod as real local processes (`stage-runtime make-tiny-model`, then `stage-runtime
serve` with two CPU ranks), images over real HTTP through the Service.

One cluster and one `tiny` stage (manifests/samples/tiny-cpu.yaml, as shipped) serve the whole module, so
the tests run in file order as one scenario: Ready → images → a failing pod → a stage too big for any
node → scale 2→3→1 with no request lost to the scale-down → kill a worker (the operator restarts the
replica) → abort through spec.abort → delete → nothing left.

The hands are the real kubectl (`kubectl apply -f` of the sample, `wait`, `scale`, `patch`, `delete`; plus
`get` and `describe` steps) where it is installed, else the same calls over HTTP (e2e/local/driver.py).
"""
from __future__ import annotations

import base64
import os
import signal
import sys
import threading
import time

import httpx
import pytest
import yaml

from e2e import scenario
from e2e.local.cluster import FAKE_GPUS, LocalCluster
from e2e.local.kubectl import KUBECTL, KUBECTL_MISSING, Kubectl, KubectlDriver
from e2e.local.load import Load
from e2e.local.pod_process import group_members

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith('linux'),
                       reason='the local pod runner gives each pod a 127.x.y.z address and reads /proc: Linux only'),
    pytest.mark.timeout(240),
]
TINY = 'tiny'
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason=KUBECTL_MISSING)
LONG_REQUEST = {'prompt': 'long', 'size': '64x64', 'num_inference_steps': 500, 'request_id': 'e2e-long'}  # ~10 s+


@pytest.fixture(scope='module')
def cluster(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp('local-cluster')) as local:
        yield local
    log = local.operator_log
    assert local.operator.returncode == 0, log[-3000:]
    assert 'Traceback' not in log, log[-5000:]
    assert not local.runner.errors, local.runner.errors


@pytest.fixture(scope='module')
def kubectl(cluster) -> Kubectl | None:
    return Kubectl(cluster.kubeconfig) if KUBECTL is not None else None


@pytest.fixture(scope='module')
def hands(cluster, kubectl):
    """What a user's commands go through: kubectl where installed, else the HTTP driver."""
    return KubectlDriver(cluster, kubectl) if kubectl is not None else cluster


@pytest.fixture(scope='module')
def tiny(cluster, kubectl):
    if kubectl is None:
        cluster.apply(scenario.sample())
    else:
        applied = kubectl('apply', '-f', str(scenario.SAMPLE))  # validation on: OpenAPI v3 + fieldValidation
        assert applied.stdout.strip() == 'diffusionstage.diffstage.io/tiny created', applied
        waited = kubectl('wait', '--for=condition=Ready', f'dstage/{TINY}', '--timeout=150s', timeout=160)
        assert waited.stdout.strip() == 'diffusionstage.diffstage.io/tiny condition met', waited
        assert waited.stderr == '', f'no watch error: {waited.stderr}'
    scenario.wait_ready(cluster, TINY, 2, timeout=150)
    return TINY


def test_the_sample_becomes_ready_and_serves_images_through_its_service(cluster, tiny):
    status = scenario.status(cluster, tiny)
    assert status['topology']['worldSize'] == 2 and status['selector'] == 'diffstage.io/stage=tiny'
    assert scenario.condition(cluster, tiny, 'Ready')['status'] == 'True'
    pods = {p['metadata']['name']: p['status'] for p in cluster.pods(tiny)}
    assert sorted(pods) == ['tiny-0', 'tiny-1']
    for pod in pods.values():  # what the pod runner reported: the init container built the model, then serve
        assert pod['phase'] == 'Running' and pod['podIP'].startswith('127.')
        assert pod['initContainerStatuses'][0]['state']['terminated']['exitCode'] == 0
    assert len(cluster.services.endpoints('default', tiny)) == 2
    first, second = (scenario.generate(cluster, tiny, seed=3) for _ in range(2))  # round robin: both replicas
    assert first == second, 'the same seed gives the same image on every replica'


def test_the_api_servers_service_proxy_reaches_a_ready_pod(cluster, tiny):
    """What `make cluster` tells a user to curl: the Service through the API's proxy subresource."""
    url = f'{cluster.emulator.base_url}/api/v1/namespaces/default/services/{tiny}:http/proxy/v1/images/generations'
    response = httpx.post(url, timeout=60, json={'prompt': 'a lighthouse', 'size': '64x64', 'seed': 3,
                                                 'num_inference_steps': 4})
    assert response.status_code == 200, response.text
    assert response.json()['data'][0]['b64_json'] == base64.b64encode(scenario.generate(cluster, tiny, seed=3)).decode()
    missing = httpx.get(f'{cluster.emulator.base_url}/api/v1/namespaces/default/services/nope/proxy/health')
    assert missing.status_code == 404 and missing.json()['reason'] == 'NotFound'


@needs_kubectl
def test_kubectl_get_shows_the_printer_columns_of_the_ready_stage(kubectl, tiny):
    lines = kubectl('get', 'dstage').stdout.splitlines()
    assert lines[0].split() == ['NAME', 'PHASE', 'READY', 'REPLICAS', 'GPUS', 'RESTARTS', 'AGE'], lines
    assert lines[1].split()[:5] == ['tiny', 'Ready', '2', '2', '2'], lines
    pods = kubectl('get', 'pods', '-l', f'diffstage.io/stage={tiny}').stdout.splitlines()
    assert [line.split()[:3] for line in pods[1:]] == [['tiny-0', '1/1', 'Running'], ['tiny-1', '1/1', 'Running']]


@needs_kubectl
def test_kubectl_refuses_a_wrong_product_before_the_operator_sees_it(cluster, kubectl, tiny):
    bad = scenario.with_spec(scenario.sample(), parallel={'cfgParallelSize': 2, 'ulyssesDegree': 2})
    bad['metadata']['name'] = 'wrong-product'
    refused = kubectl('apply', '-f', '-', input=yaml.safe_dump(bad), check=False)
    assert refused.returncode != 0
    assert 'parallel degrees multiply to 4' in refused.stderr and 'but resources.gpusPerPod is 2' in refused.stderr
    assert cluster.stage('wrong-product') is None and 'wrong-product' not in cluster.operator_log


def test_a_failing_pod_reports_exit_code_and_termination_message(cluster, hands, tiny):
    broken = scenario.with_spec(scenario.sample(), replicas=1, model={'path': '/models/missing'},
                                parallel={}, resources={'gpusPerPod': 1, 'gpuResourceName': ''})
    broken['metadata']['name'] = 'broken'
    hands.apply(broken)
    failure = scenario.wait_for(
        lambda: next((r.get('lastFailure') for r in scenario.status(cluster, 'broken').get('replicaStatuses') or ()
                      if r.get('lastFailure')), None), 90, 'the failure in status',
        lambda: scenario.status(cluster, 'broken'))
    assert failure['exitCode'] == 2, failure  # a configuration error: permanent
    assert '/models/missing' in failure['message'], failure  # the stage's own termination message
    assert scenario.condition(cluster, 'broken', 'Degraded')['status'] == 'True'
    scenario.delete(hands, 'broken', 30)
    assert scenario.is_ready(cluster, tiny, 2), 'the other stage is untouched'


def test_a_stage_bigger_than_any_node_is_refused(hands, tiny):
    scenario.refused_for_gpu_capacity(hands, FAKE_GPUS, timeout=30)


@pytest.fixture(scope='module')
def scale_down_load() -> dict:
    return {}


def test_scale_2_to_3_to_1(cluster, hands, tiny, scale_down_load):
    scenario.scale(hands, tiny, 3, timeout=150)
    assert len(cluster.services.endpoints('default', tiny)) == 3
    scenario.generate(cluster, tiny)
    with Load(cluster, tiny) as load:  # what the clients saw is judged by test_scale_down_lost_no_request
        scenario.scale(hands, tiny, 1, timeout=60)
        scenario.wait_for(lambda: len(cluster.runner.running()) == 1, 60, 'the removed pods to stop',
                          cluster.runner.running)
        time.sleep(1)
    scale_down_load.update(answers=load.answers, failures=load.failures)
    assert len(cluster.services.endpoints('default', tiny)) == 1
    scenario.generate(cluster, tiny)


def test_scale_down_lost_no_request(scale_down_load):
    assert scale_down_load, 'test_scale_2_to_3_to_1 ran first and put load on the scale-down'
    assert scale_down_load['answers'] >= 3, scale_down_load
    assert not scale_down_load['failures'], scale_down_load['failures'][:5]


def test_the_long_request_of_the_abort_test_is_valid():
    from stage_runtime.serve.schemas import ImageGenerationRequest

    ImageGenerationRequest.model_validate(LONG_REQUEST)


def _stage_worker(cluster, pod_name: str) -> int:
    """A rank process of the pod's stage (a child of its `stage-runtime serve` process)."""
    thread = next(t for t in cluster.runner._every if t.pod['metadata']['name'] == pod_name and t.is_alive())
    serve = thread.local.process.pid
    members = group_members([serve])
    children = [pid for pid in members if pid != serve and _ppid(pid) == serve]
    assert children, f'no worker processes under {serve}: {members}'
    return children[-1]


def _ppid(pid: int) -> int:
    with open(f'/proc/{pid}/stat') as f:
        text = f.read()
    return int(text[text.rindex(')') + 2:].split()[1])


def test_a_killed_worker_restarts_the_replica_and_status_records_it(cluster, hands, tiny):
    hands.patch_spec(tiny, {'restartPolicy': {'backoffInitialSeconds': 1, 'backoffMaxSeconds': 2}})
    worker = _stage_worker(cluster, 'tiny-0')
    os.kill(worker, signal.SIGKILL)
    failure = scenario.wait_for(
        lambda: next((r.get('lastFailure') for r in scenario.status(cluster, tiny).get('replicaStatuses') or ()
                      if r.get('lastFailure')), None), 30, 'the failure in status')
    assert failure['exitCode'] == 3 and failure['reason'] == 'WorkerDied', failure
    scenario.wait_for(lambda: (scenario.status(cluster, tiny).get('restarts') or {}).get('total') == 1, 15,
                      'the restart in status.restarts', lambda: scenario.status(cluster, tiny))
    scenario.wait_ready(cluster, tiny, 1, timeout=120)
    scenario.generate(cluster, tiny)


def test_abort_through_spec_abort_ends_the_running_request(cluster, hands, tiny):
    url = scenario.wait_for(lambda: cluster.service_url(tiny), 10, 'a ready replica')
    answers: list[httpx.Response] = []
    request = threading.Thread(target=lambda: answers.append(httpx.post(
        f'{url}/v1/images/generations', timeout=120, json=LONG_REQUEST)))
    request.start()
    try:
        scenario.wait_for(lambda: httpx.get(f'{url}/v1/requests', timeout=5).json().get('requests'), 20,
                          'the request to run')
        assert not answers, answers[0].text
        hands.patch_spec(tiny, {'abort': {'id': 'e2e-1', 'all': True}})
        abort = scenario.wait_for(lambda: (scenario.status(cluster, tiny).get('abort') or {}).get('observedId'),
                                  15, 'status.abort', lambda: scenario.status(cluster, tiny))
        assert abort == 'e2e-1'
        request.join(15)
        assert answers and answers[0].status_code == 409, answers and answers[0].text
    finally:  # if the abort did not land, end the request here so the stage can be deleted quickly
        httpx.post(f'{url}/v1/abort', json={'all': True}, timeout=10)
        request.join(30)


@needs_kubectl
def test_kubectl_describe_shows_the_operators_events(kubectl, cluster, tiny):
    scenario.wait_for(lambda: 'Aborted' in kubectl('describe', 'dstage', tiny).stdout, 15, 'the Aborted Event')
    described = kubectl('describe', 'dstage', tiny).stdout
    events = described[described.index('Events:'):]
    for reason in ('RestartingReplica', 'Aborted'):  # the killed worker's replica, the abort
        assert reason in events, (reason, events)
    assert 'abort e2e-1: aborted 1 request(s) e2e-long' in events, events


def test_delete_leaves_no_process_and_no_shm(cluster, hands, tiny):
    started = time.monotonic()
    scenario.delete(hands, tiny, 30)
    scenario.wait_for(lambda: not cluster.runner.running(), 60, 'every pod process to stop', cluster.runner.running)
    assert time.monotonic() - started < 60
    assert not cluster.runner.leftovers, cluster.runner.leftovers
    assert not group_members(cluster.runner.all_groups), 'no process of any pod is left'
    assert not {k: v for k, v in cluster.leftovers().items() if k != 'operator'}, cluster.leftovers()
