"""Tier 4: the whole system on the embedded local cluster (docs/testing.md). The emulated API, the operator as a
real process, every pod as real local processes (`stage-runtime make-tiny-model`, then `stage-runtime
serve` with two CPU ranks), images over real HTTP through the Service.

One cluster serves the whole module; the `tiny` fixture gives each test the sample stage
(manifests/samples/tiny-cpu.yaml, as shipped) Ready with 2 replicas, whatever the test before it did (it
applies the sample again after a deletion, patches back a changed spec, scales back); `tiny_one` the same at
1 replica, for the tests a second replica proves nothing in (what the scale-down leaves: no pod started only
to be killed or deleted). So every test stands alone, in any order: Ready → images → a failing pod → a stage
too big for any node → scale 2→3→1 with no request lost to the scale-down → kill a worker (the operator
restarts the replica) → abort through spec.abort, seen in `kubectl describe` → delete → nothing left.

The hands are the real kubectl (`kubectl apply -f` of the sample, `wait`, `scale`, `patch`, `delete`; plus
`get` and `describe` steps) where it is installed, else the same calls over HTTP (e2e/local/driver.py).
"""
from __future__ import annotations

import base64
import os
import signal
import sys
import threading
import uuid

import httpx
import pytest
import yaml

from e2e import scenario
from e2e.local.cluster import FAKE_GPUS, LocalCluster
from e2e.local.kubectl import KUBECTL, KUBECTL_MISSING, Kubectl, KubectlDriver
from e2e.local.load import Load
from e2e.local.pod_process import group_members, parent_pid

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith('linux'),
                       reason='the local pod runner gives each pod a 127.x.y.z address and reads /proc: Linux only'),
    pytest.mark.timeout(240),
]
TINY = 'tiny'
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason=KUBECTL_MISSING)
LONG_REQUEST = {'prompt': 'long', 'size': '64x64', 'num_inference_steps': 900}  # ~20 s+: aborted long before


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
def applied(cluster, kubectl):
    """The sample applied once as a user does: `kubectl apply -f`, then `kubectl wait`."""
    if kubectl is None:
        cluster.apply(scenario.sample())
    else:
        applied = kubectl('apply', '-f', str(scenario.SAMPLE))  # validation on: OpenAPI v3 + fieldValidation
        assert applied.stdout.strip() == 'diffusionstage.diffstage.io/tiny created', applied
        waited = kubectl('wait', '--for=condition=Ready', f'dstage/{TINY}', '--timeout=150s', timeout=160)
        assert waited.stdout.strip() == 'diffusionstage.diffstage.io/tiny condition met', waited
        assert waited.stderr == '', f'no watch error: {waited.stderr}'
    return TINY


@pytest.fixture
def tiny(cluster, applied):
    """The sample stage as shipped, Ready with its 2 replicas, whatever the test before this one left."""
    scenario.restore(cluster, scenario.sample(), timeout=150)
    return TINY


@pytest.fixture
def tiny_one(cluster, applied):
    """The sample stage as shipped but for its 1 replica, Ready, whatever the test before this one left."""
    scenario.restore(cluster, scenario.with_spec(scenario.sample(), replicas=1), timeout=150)
    return TINY


def pod_names(cluster, stage: str) -> list[str]:
    return sorted(p['metadata']['name'] for p in cluster.pods(stage))


def test_the_sample_becomes_ready_and_serves_images_through_its_service(cluster, tiny):
    status = scenario.status(cluster, tiny)
    assert status['topology']['worldSize'] == 2 and status['selector'] == 'diffstage.io/stage=tiny'
    assert scenario.condition(cluster, tiny, 'Ready')['status'] == 'True'
    pods = {p['metadata']['name']: p['status'] for p in cluster.pods(tiny)}
    assert len(pods) == 2 and all(name.startswith('tiny-') for name in pods), sorted(pods)
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


def test_the_playground_page_through_the_service_draws_what_the_api_answers(cluster, tiny):
    """The page each replica serves, opened in a real headless Chromium at the Service's address."""
    from stage_runtime.imageio import decode_image
    from support.browser import chromium, image_of, open_page

    url = scenario.wait_for(lambda: cluster.service_url(tiny), 30, f'an endpoint behind Service {tiny}')
    with chromium() as browser, open_page(browser, f'{url}/') as (page, watch):
        page.wait_for_selector("body[data-ready='1']")
        assert page.inner_text('#model-name') == tiny                  # the served name the operator passed
        page.fill('#prompt', 'a lighthouse')
        page.fill('#width', '64')
        page.fill('#height', '64')
        page.fill('#steps', '4')
        page.fill('#seed', '3')
        page.click('#generate')
        page.wait_for_selector(".card[data-state='completed'] img[data-final]", timeout=120_000)
        drawn = image_of(page, '.card img[data-final]')
    answered = decode_image(scenario.generate(cluster, tiny, seed=3), 'image', 1 << 20)
    assert (drawn == answered).all(), 'the page shows the image the API answers for the same request'


@needs_kubectl
def test_kubectl_get_shows_the_printer_columns_of_the_ready_stage(cluster, kubectl, tiny):
    lines = kubectl('get', 'dstage', tiny).stdout.splitlines()
    assert lines[0].split() == ['NAME', 'PHASE', 'READY', 'REPLICAS', 'GPUS', 'RESTARTS', 'AGE'], lines
    assert lines[1].split()[:5] == ['tiny', 'Ready', '2', '2', '0'], lines  # CPU ranks: no GPU asked for
    pods = kubectl('get', 'pods', '-l', f'diffstage.io/stage={tiny}').stdout.splitlines()
    assert [line.split()[:3] for line in pods[1:]] == [[name, '1/1', 'Running'] for name in pod_names(cluster, tiny)]


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


def test_scale_2_to_3_to_1_loses_no_request(cluster, hands, tiny):
    # step 1: up to 3, all serving
    scenario.scale(hands, tiny, 3, timeout=150)
    assert len(cluster.services.endpoints('default', tiny)) == 3
    scenario.generate(cluster, tiny)
    # step 2: down to 1 under steady load through the Service
    with Load(cluster, tiny) as load:
        scenario.scale(hands, tiny, 1, timeout=60)
        scenario.wait_for(lambda: len(cluster.runner.running()) == 1, 60, 'the removed pods to stop',
                          cluster.runner.running)
        served = load.answers
        scenario.wait_for(lambda: load.answers >= served + 2, 60, 'the Service to keep answering after the removal',
                          lambda: load.failures[:5])
    # step 3: what the clients saw: every request answered 200, and the Service still serves
    assert load.answers >= 3, (load.answers, load.failures[:5])
    assert not load.failures, load.failures[:5]
    assert len(cluster.services.endpoints('default', tiny)) == 1
    scenario.generate(cluster, tiny)


def test_the_long_request_of_the_abort_test_is_valid():
    from stage_runtime.serve.schemas import ImageGenerationRequest

    ImageGenerationRequest.model_validate(LONG_REQUEST)


def _stage_worker(cluster, pod_name: str) -> int:
    """A rank process of the pod's stage (a child of its `stage-runtime serve` process)."""
    thread = next(t for t in cluster.runner._every if t.pod['metadata']['name'] == pod_name and t.is_alive())
    serve = thread.local.process.pid
    members = group_members([serve])
    children = [pid for pid in members if pid != serve and parent_pid(pid) == serve]
    assert children, f'no worker processes under {serve}: {members}'
    return children[-1]


def _last_failure(cluster, stage: str, pod: str) -> dict:
    return next((r.get('lastFailure') or {} for r in scenario.status(cluster, stage).get('replicaStatuses') or ()
                 if r['pod'] == pod), {})


def test_a_killed_worker_restarts_the_replica_and_status_records_it(cluster, hands, kubectl, tiny_one):
    tiny = tiny_one
    # A backoff well past the ~1 s the stage takes to exit after a rank dies: the pod's exit (code 3, the stage's
    # termination message) is recorded before the replica is recreated. The probe may see /health 503 first
    # (reason Unhealthy, no exit code): that is not the final record, so the wait is for the exit code.
    hands.patch_spec(tiny, {'restartPolicy': {'backoffInitialSeconds': 8, 'backoffMaxSeconds': 8}})
    restarts = (scenario.status(cluster, tiny).get('restarts') or {}).get('total', 0)
    victim = pod_names(cluster, tiny)[0]
    old_uid = next(p['metadata']['uid'] for p in cluster.pods(tiny) if p['metadata']['name'] == victim)
    os.kill(_stage_worker(cluster, victim), signal.SIGKILL)
    failure = scenario.wait_for(lambda: 'exitCode' in (f := _last_failure(cluster, tiny, victim)) and f, 60,
                                f'the exit code of {victim} in its lastFailure', lambda: scenario.status(cluster, tiny))
    assert failure['exitCode'] == 3 and failure['reason'] == 'WorkerDied', failure
    scenario.wait_for(lambda: (scenario.status(cluster, tiny).get('restarts') or {}).get('total') == restarts + 1,
                      60, 'the restart in status.restarts', lambda: scenario.status(cluster, tiny))
    scenario.wait_ready(cluster, tiny, 1, timeout=120)
    scenario.generate(cluster, tiny)
    if kubectl is not None:
        events = kubectl('describe', 'dstage', tiny).stdout.split('Events:')[-1]
        assert 'RestartingReplica' in events and f'recreating {victim} after WorkerDied' in events, events
        # the replacement is a new pod of the same name: no previous container, as on a real cluster ...
        previous = kubectl('logs', victim, '--previous', check=False)
        assert previous.stderr.strip().endswith(
            f'Error from server (BadRequest): previous terminated container "stage" in pod "{victim}" not found')
        assert 'ready: ' in kubectl('logs', victim).stdout
    # ... and the failed pod's log stays on the node, by its uid
    assert 'ready: ' in (cluster.logs_dir / f'default_{victim}_{old_uid}' / 'stage' / '0.log').read_text()


def test_abort_through_spec_abort_ends_the_running_request_and_describe_shows_it(cluster, hands, kubectl, tiny_one):
    tiny = tiny_one
    url = scenario.wait_for(lambda: cluster.service_url(tiny), 30, 'a ready replica')
    abort_id, request_id = f'e2e-{uuid.uuid4().hex[:8]}', f'e2e-long-{uuid.uuid4().hex[:8]}'
    answers: list[httpx.Response] = []
    request = threading.Thread(target=lambda: answers.append(httpx.post(
        f'{url}/v1/images/generations', timeout=300, json={**LONG_REQUEST, 'request_id': request_id})))
    request.start()
    try:
        # step 1: the request runs
        scenario.wait_for(lambda: answers or httpx.get(f'{url}/v1/requests', timeout=5).json().get('requests'), 60,
                          'the request to run', lambda: httpx.get(f'{url}/v1/requests', timeout=5).text)
        assert not answers, answers[0].text
        # step 2: spec.abort, observed in status, ends it with 409
        hands.patch_spec(tiny, {'abort': {'id': abort_id, 'all': True}})
        abort = scenario.wait_for(lambda: (scenario.status(cluster, tiny).get('abort') or {}).get('observedId')
                                  == abort_id and scenario.status(cluster, tiny)['abort'], 60, 'status.abort',
                                  lambda: scenario.status(cluster, tiny))
        assert request_id in abort['aborted'], abort
        request.join(60)
        assert answers and answers[0].status_code == 409, answers and answers[0].text
    finally:  # if the abort did not land, end the request here so the stage can be deleted quickly
        httpx.post(f'{url}/v1/abort', json={'all': True}, timeout=10)
        request.join(60)
    # step 3: the operator's Event, as `kubectl describe` shows it
    if kubectl is not None:
        expected = f'abort {abort_id}: aborted 1 request(s) {request_id}'
        events = scenario.wait_for(lambda: expected in (e := kubectl('describe', 'dstage', tiny).stdout.split(
            'Events:')[-1]) and e, 30, 'the Aborted Event', lambda: kubectl('describe', 'dstage', tiny).stdout)
        assert 'Aborted' in events, events


def test_delete_leaves_no_process_and_no_shm(cluster, hands, tiny_one):
    tiny = tiny_one
    scenario.delete(hands, tiny, 30)
    scenario.wait_for(lambda: not cluster.runner.running(), 60, 'every pod process to stop', cluster.runner.running)
    assert not cluster.runner.leftovers, cluster.runner.leftovers
    assert not group_members(cluster.runner.all_groups), 'no process of any pod is left'
    assert not {k: v for k, v in cluster.leftovers().items() if k != 'operator'}, cluster.leftovers()
