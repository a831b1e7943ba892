"""The real `kubectl` (1.32) against the emulated API, validation on, as a user types it: apply of the
sample, the CRD's printer columns from server-side Tables, `explain`, `wait` over a watch, and the refusals
a real API server gives (CEL rule, schema maximum, unknown fields). The stage's life with the operator and
real pods (scale, abort, describe with Events, delete) is in test_local_cluster.py, whose hands are kubectl.
"""
from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import httpx
import pytest
import yaml

from e2e import scenario
from e2e.local.kube_emulator import running
from e2e.local.kubectl import KUBECTL, KUBECTL_MISSING, Kubectl
from stage_operator.api.meta import API_VERSION, PLURAL

pytestmark = pytest.mark.skipif(KUBECTL is None, reason=KUBECTL_MISSING)
MERGE = {'Content-Type': 'application/merge-patch+json'}
STAGES = f'/apis/{API_VERSION}/namespaces/default/{PLURAL}'


@pytest.fixture(scope='module')
def api(tmp_path_factory):
    with running() as emulator:
        yield emulator
        crashes = list(emulator.errors)
    assert not crashes, f'the emulator crashed on requests: {crashes!r}'


@pytest.fixture(scope='module')
def kubectl(api, tmp_path_factory) -> Kubectl:
    return Kubectl(api.write_kubeconfig(tmp_path_factory.mktemp('kubectl') / 'kubeconfig'))


@pytest.fixture
def http(api):
    with httpx.Client(base_url=api.base_url, timeout=10) as client:
        yield client


def stage_yaml(name: str, **spec) -> str:
    manifest = scenario.with_spec(scenario.sample(), **spec)
    manifest['metadata']['name'] = name
    return yaml.safe_dump(manifest)


def ready_status(http: httpx.Client, name: str) -> None:
    status = {'phase': 'Ready', 'replicas': 2, 'readyReplicas': 2, 'restarts': {'total': 1},
              'conditions': [{'type': 'Ready', 'status': 'True', 'reason': 'AllReplicasReady', 'message': '2/2',
                              'lastTransitionTime': '2026-12-01T00:00:00Z'}]}
    response = http.patch(f'{STAGES}/{name}/status', headers=MERGE, json={'status': status})
    assert response.status_code == 200, response.text


def test_apply_of_the_sample_validates_and_creates_it(kubectl, api, http):
    http.delete(f'{STAGES}/tiny')  # another test of this module may have applied it already
    scenario.wait_for(lambda: api.get('dstage', 'tiny') is None, 10, 'no stage tiny')
    out = kubectl('apply', '-f', str(scenario.SAMPLE))
    assert out.stdout.strip() == 'diffusionstage.diffstage.io/tiny created', out
    stored = api.get('dstage', 'tiny')
    assert stored['spec']['engine']['maxNumSeqs'] == 4 and stored['spec']['restartPolicy']['maxRestarts'] == 5, \
        'the schema defaults were applied'
    again = kubectl('apply', '-f', str(scenario.SAMPLE))
    assert again.stdout.strip() == 'diffusionstage.diffstage.io/tiny unchanged', again
    assert 'openapi' not in again.stderr, again.stderr


# statuses the operator's own reconcile wrote (recorded for the Argo CD health tests): a CPU-rank stage Ready, one
# rolled back (Degraded though its Ready condition is another story), one being deleted, one asking for more GPUs
# than any node has
RECORDED = Path(scenario.ROOT) / 'manifests' / 'argocd' / 'testdata'
COLUMN_CASES = {'cols-ready': 'healthy', 'cols-rolled-back': 'rollout-failed', 'cols-deleting': 'deleting',
                'cols-gpus': 'accepted-false-insufficient-gpus'}


def test_get_dstage_prints_the_crd_columns_and_wide_explains_the_phase(kubectl, http):
    for name, case in COLUMN_CASES.items():
        recorded = yaml.safe_load((RECORDED / f'{case}.yaml').read_text())
        created = http.post(STAGES, json={'apiVersion': recorded['apiVersion'], 'kind': recorded['kind'],
                                          'metadata': {'name': name}, 'spec': recorded['spec']})
        assert created.status_code == 201, created.text
        written = http.patch(f'{STAGES}/{name}/status', headers=MERGE, json={'status': recorded['status']})
        assert written.status_code == 200, written.text
    try:
        lines = kubectl('get', 'dstage', *COLUMN_CASES).stdout.splitlines()
        assert lines[0].split() == ['NAME', 'PHASE', 'READY', 'REPLICAS', 'GPUS', 'RESTARTS', 'AGE'], lines
        assert [line.split()[:6] for line in lines[1:]] == [  # in the order asked for
            ['cols-ready', 'Ready', '2', '2', '0', '0'],  # CPU ranks: no GPU asked for
            ['cols-rolled-back', 'Degraded', '1', '2', '0', '0'],
            ['cols-deleting', 'Terminating', '2', '2', '0', '0'],
            ['cols-gpus', 'Pending', '0', '2', '2', '0']], lines  # 2 nvidia.com/gpu per pod
        wide = kubectl('get', 'dstage', *COLUMN_CASES, '-o', 'wide').stdout.splitlines()
        assert wide[0].split() == ['NAME', 'PHASE', 'REASON', 'READY', 'SLEEPING', 'REPLICAS', 'GPUS', 'RANKS',
                                   'QUEUED', 'JOBS', 'RESTARTS', 'AGE'], wide
        assert [line.split()[:7] for line in wide[1:]] == [  # SLEEPING blank: only with spec.sleep
            ['cols-ready', 'Ready', 'AllReplicasReady', '2', '2', '0', '2'],
            ['cols-rolled-back', 'Degraded', 'RolloutFailed', '1', '2', '0', '2'],
            ['cols-deleting', 'Terminating', 'Draining', '2', '2', '0', '2'],
            ['cols-gpus', 'Pending', 'InsufficientGPUCapacity', '0', '2', '2', '2']], wide
    finally:
        for name in COLUMN_CASES:
            http.delete(f'{STAGES}/{name}')


def test_get_pods_prints_the_builtin_columns(kubectl, api):
    api.seed('pods', {'metadata': {'name': 'p-0'}, 'spec': {'containers': [{'name': 'stage'}], 'nodeName': 'local'},
                      'status': {'phase': 'Running', 'podIP': '127.0.0.9', 'containerStatuses': [
                          {'name': 'stage', 'ready': True, 'restartCount': 0, 'state': {'running': {}}}]}})
    lines = kubectl('get', 'pods', '-o', 'wide').stdout.splitlines()
    assert lines[0].split()[:7] == ['NAME', 'READY', 'STATUS', 'RESTARTS', 'AGE', 'IP', 'NODE'], lines
    row = next((line for line in lines[1:] if line.split()[0] == 'p-0'), '')
    assert row.split()[:3] == ['p-0', '1/1', 'Running'] and '127.0.0.9' in row, lines


def test_get_lists_rows_by_name_not_by_creation(kubectl, api):
    """As a real API server lists (etcd's key order): a recreated tiny-0 prints before tiny-1."""
    for name in ('order-1', 'order-0', 'order-10'):
        api.seed('configmaps', {'metadata': {'name': name}, 'data': {}})
    rows = [line.split()[0] for line in kubectl('get', 'configmaps').stdout.splitlines()[1:]]
    assert [name for name in rows if name.startswith('order-')] == ['order-0', 'order-1', 'order-10'], rows


def test_explain_reads_the_schema_from_openapi_v3(kubectl):
    out = kubectl('explain', 'dstage.spec.parallel').stdout
    assert 'KIND:       DiffusionStage' in out and 'FIELD: parallel <Object>' in out, out
    assert 'their product is the world size' in out and 'cfgParallelSize\t<integer>' in out, out
    recursive = kubectl('explain', 'dstage.spec', '--recursive').stdout
    assert 'gpusPerPod' in recursive and 'restartPolicy' in recursive, recursive


def test_wait_for_ready_over_a_watch_without_errors(kubectl, api, http):
    kubectl('apply', '-f', '-', input=stage_yaml('waiting'))
    watches = api.watching(PLURAL)
    waiter = subprocess.Popen([kubectl.binary, 'wait', '--for=condition=Ready', f'{PLURAL}/waiting', '--timeout=60s'],
                              env=kubectl.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:  # Ready only once kubectl watches (it would print a watch error here): the condition arrives as an event
        scenario.wait_for(lambda: api.watching(PLURAL) > watches or waiter.poll() is not None, 30,
                          'kubectl wait to open its watch')
        ready_status(http, 'waiting')
        out, err = waiter.communicate(timeout=30)
    finally:
        waiter.kill()
    assert waiter.returncode == 0, (out, err)
    assert out.strip() == 'diffusionstage.diffstage.io/waiting condition met' and err == '', (out, err)


def test_get_watch_streams_table_rows(kubectl, http):
    kubectl('apply', '-f', '-', input=stage_yaml('watched'))
    lines: list[str] = []
    watcher = subprocess.Popen([kubectl.binary, 'get', 'dstage', 'watched', '--watch'], env=kubectl.env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reader = threading.Thread(target=lambda: lines.extend(watcher.stdout), daemon=True)
    reader.start()
    try:
        scenario.wait_for(lambda: len(lines) >= 2, 15, 'the header and the first row', lambda: lines)
        ready_status(http, 'watched')
        scenario.wait_for(lambda: any(' Ready ' in line for line in lines), 15, 'the Ready row', lambda: lines)
    finally:
        watcher.kill()
        reader.join(5)
    assert lines[0].split()[:2] == ['NAME', 'PHASE'] and lines[1].split()[0] == 'watched', lines
    assert watcher.stderr.read() == ''


def test_a_wrong_parallel_product_is_refused_with_the_cel_message(kubectl, api):
    bad = stage_yaml('bad-product', parallel={'cfgParallelSize': 2, 'ulyssesDegree': 2},
                     resources={'gpusPerPod': 2, 'gpuResourceName': ''})
    out = kubectl('apply', '-f', '-', input=bad, check=False)
    assert out.returncode != 0
    assert out.stderr.strip() == (
        'The DiffusionStage "bad-product" is invalid: spec: Invalid value: "object": parallel degrees multiply to 4 '
        '(tensor 1 x ulysses 2 x ring 1 x cfg 2 x data 1 x pipeline 1) but resources.gpusPerPod is 2'), out.stderr
    assert api.get('dstage', 'bad-product') is None, 'nothing stored: the operator never sees it'


def test_cfg_parallel_3_is_refused_by_the_schema_maximum(kubectl, api):
    bad = stage_yaml('bad-cfg', parallel={'cfgParallelSize': 3}, resources={'gpusPerPod': 3, 'gpuResourceName': ''})
    out = kubectl('apply', '-f', '-', input=bad, check=False)
    assert out.returncode != 0
    assert out.stderr.strip() == ('The DiffusionStage "bad-cfg" is invalid: spec.parallel.cfgParallelSize: Invalid '
                                  'value: 3: spec.parallel.cfgParallelSize in body should be less than or equal to 2')
    assert api.get('dstage', 'bad-cfg') is None


def test_an_unknown_quantization_method_and_gguf_without_its_file_are_refused(kubectl, api):
    """spec.quantization: the schema's enum (the runtime's methods) and its CEL rule, before the operator sees it."""
    bad = kubectl('apply', '-f', '-', input=stage_yaml('bad-quant', quantization={'method': 'int4'}), check=False)
    assert bad.returncode != 0 and bad.stderr.startswith('The DiffusionStage "bad-quant" is invalid: '), bad.stderr
    assert ('* spec.quantization.method: Unsupported value: "int4": supported values: "none", "fp8-storage", '
            '"int8-weight", "fp8", "gguf"\n') in bad.stderr, bad.stderr  # and: CEL rules not checked (as a real one)
    no_file = kubectl('apply', '-f', '-', input=stage_yaml('no-file', quantization={'method': 'gguf'}), check=False)
    assert no_file.returncode != 0
    assert no_file.stderr.strip() == (
        'The DiffusionStage "no-file" is invalid: spec.quantization: Invalid value: "object": quantization.method gguf '
        'needs file: the pre-quantized denoiser (.gguf), a path relative to the model folder or absolute'), \
        no_file.stderr
    assert api.get('dstage', 'bad-quant') is None and api.get('dstage', 'no-file') is None


def test_an_unknown_field_is_refused_strictly_and_pruned_without_validation(kubectl, api):
    unknown = stage_yaml('unknown', replicas=0, bogus=1, engine={'maxNumSeqs': 2, 'nope': True})
    strict = kubectl('apply', '-f', '-', input=unknown, check=False)
    assert strict.returncode != 0
    assert 'strict decoding error: unknown field "spec.bogus", unknown field "spec.engine.nope"' in strict.stderr
    assert api.get('dstage', 'unknown') is None
    warned = kubectl('apply', '--validate=warn', '-f', '-', input=unknown)
    assert 'Warning: unknown field "spec.bogus"' in warned.stderr, warned.stderr
    kubectl('apply', '--validate=false', '-f', '-', input=unknown)
    spec = api.get('dstage', 'unknown')['spec']
    assert 'bogus' not in spec and 'nope' not in spec['engine'] and spec['engine']['maxNumSeqs'] == 2, spec
    kubectl('delete', PLURAL, 'unknown')


def test_scale_patch_describe_and_delete(kubectl, api, http):
    kubectl('apply', '-f', '-', input=stage_yaml('hands'))
    assert kubectl('scale', PLURAL, 'hands', '--replicas=3').stdout.strip() == 'diffusionstage.diffstage.io/hands scaled'
    assert api.get('dstage', 'hands')['spec']['replicas'] == 3
    kubectl('patch', PLURAL, 'hands', '--type', 'merge', '-p', '{"spec":{"abort":{"id":"a-1","all":true}}}')
    assert api.get('dstage', 'hands')['spec']['abort'] == {'id': 'a-1', 'all': True}
    refused = kubectl('patch', PLURAL, 'hands', '--type', 'merge', '-p', '{"spec":{"replicas":-1}}', check=False)
    assert refused.returncode != 0 and 'spec.replicas in body should be greater than or equal to 0' in refused.stderr
    stage = api.get('dstage', 'hands')
    api.seed('events', {'metadata': {'name': 'hands.1'}, 'type': 'Normal', 'reason': 'Aborted', 'message': 'aborted 0',
                        'involvedObject': {'apiVersion': API_VERSION, 'kind': 'DiffusionStage', 'name': 'hands',
                                           'namespace': 'default', 'uid': stage['metadata']['uid']},
                        'lastTimestamp': stage['metadata']['creationTimestamp']})
    described = kubectl('describe', PLURAL, 'hands').stdout
    events = described[described.index('Events:'):]
    assert 'Normal' in events and 'Aborted' in events and 'aborted 0' in events, described
    assert kubectl('delete', PLURAL, 'hands').stdout.strip() == 'diffusionstage.diffstage.io "hands" deleted'
    assert api.get('dstage', 'hands') is None


def test_crds_are_listed_and_come_from_the_crds_folder(kubectl):
    names = kubectl('get', 'crd', '-o', 'name').stdout.split()
    assert names == ['customresourcedefinition.apiextensions.k8s.io/diffusionstages.diffstage.io',
                     # another project's, as a cluster with an inference gateway has it (e2e/local/crds)
                     'customresourcedefinition.apiextensions.k8s.io/inferencepools.inference.networking.k8s.io']
    crd = kubectl.json('get', 'crd', 'diffusionstages.diffstage.io')
    shipped = yaml.safe_load((Path(scenario.ROOT) / 'crds' / 'diffusionstage.yaml').read_text())
    assert crd['spec'] == shipped['spec']


POOL = {'apiVersion': 'inference.networking.k8s.io/v1', 'kind': 'InferencePool', 'metadata': {'name': 'by-hand'},
        'spec': {'selector': {'matchLabels': {'app': 'x'}}, 'targetPorts': [{'number': 8000}],
                 'endpointPickerRef': {'name': 'epp', 'port': {'number': 9002}}}}


def test_kubectl_applies_an_inference_pool_with_its_defaults_and_refuses_a_broken_one(kubectl, api):
    """The local cluster knows the InferencePool CRD (e2e/local/crds): the published defaults and CEL rules apply."""
    applied = kubectl('apply', '-f', '-', input=yaml.safe_dump(POOL))
    assert applied.stdout.strip() == 'inferencepool.inference.networking.k8s.io/by-hand created', applied
    stored = api.get('inferencepools', 'by-hand')
    assert stored['spec']['appProtocol'] == 'http'
    assert stored['spec']['endpointPickerRef'] == {'name': 'epp', 'port': {'number': 9002}, 'group': '',
                                                   'kind': 'Service', 'failureMode': 'FailClose'}
    assert kubectl('get', 'infpool', '-o', 'name').stdout.split() == ['inferencepool.inference.networking.k8s.io/by-hand']
    broken = {**POOL, 'metadata': {'name': 'broken'},
              'spec': {**POOL['spec'], 'endpointPickerRef': {'name': 'epp'}, 'targetPorts': [{'number': 8000}] * 2}}
    refused = kubectl('apply', '-f', '-', input=yaml.safe_dump(broken), check=False)
    assert refused.returncode != 0 and api.get('inferencepools', 'broken') is None
    assert "port is required when kind is 'Service'" in refused.stderr and 'port number must be unique' in refused.stderr
    kubectl('delete', 'infpool', 'by-hand')
