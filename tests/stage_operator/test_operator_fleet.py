"""The real operator (kopf, in a thread) against the emulated API, for the fleet features: the InferencePool it owns
(created through the InferencePool CRD's admission, kept in line, deleted when spec.routing goes and garbage-collected
with the stage) and GPU capacity from DRA ResourceSlices on nodes without the extended resource; every API call it
made is one manifests/base/rbac.yaml grants."""
from __future__ import annotations

import pytest
from support.operator_harness import Cluster, manifest, operator, wait_for
from support.rbac import allowed

DRIVER = 'gpu.example.com'
ROUTING = {'inferencePool': {'endpointPicker': {'name': 'epp', 'port': 9003, 'failureMode': 'FailOpen'}}}


@pytest.fixture
def cluster(kube_emulator, kubeconfig):
    c = Cluster(kube_emulator)
    yield c
    c.close()


def _verb(request) -> str:
    method = request.method.value
    if method == 'GET':
        return 'watch' if request.params.get('watch') in ('true', '1') else 'get' if request.name else 'list'
    return {'POST': 'create', 'PATCH': 'patch', 'PUT': 'update', 'DELETE': 'delete'}[method]


def denied_calls(kube_emulator) -> list:
    calls = {(r.resource.group, r.resource.plural + (f'/{r.subresource}' if r.subresource else ''), _verb(r))
             for r in kube_emulator._requests if r.resource is not None and r.resource.plural
             and not r.headers.get('User-Agent', '').startswith('python-httpx')}
    return sorted(call for call in calls if not allowed(*call))


def test_the_operator_owns_an_inference_pool_over_the_serving_pods(cluster, kube_emulator):
    with operator(kube_emulator):
        uid = cluster.apply(manifest('tiny', routing=ROUTING))['metadata']['uid']
        pool = wait_for(lambda: kube_emulator.get('inferencepools', 'tiny'), what='the InferencePool')
        service = wait_for(lambda: kube_emulator.get('services', 'tiny'), what='the Service')
        assert pool['metadata']['ownerReferences'][0]['uid'] == uid
        assert pool['spec']['selector'] == {'matchLabels': service['spec']['selector']}
        assert pool['spec']['endpointPickerRef'] == {'group': '', 'kind': 'Service', 'name': 'epp',
                                                     'port': {'number': 9003}, 'failureMode': 'FailOpen'}
        wait_for(lambda: cluster.status('tiny').get('inferencePool') == 'tiny', what='status.inferencePool')
        cluster.patch_spec('tiny', {'routing': {'inferencePool': {'endpointPicker': {'name': 'epp-2'}}}})
        wait_for(lambda: kube_emulator.get('inferencepools', 'tiny')['spec']['endpointPickerRef']['name'] == 'epp-2',
                 what='the pool follows the spec')
        cluster.patch_spec('tiny', {'routing': None})
        wait_for(lambda: kube_emulator.get('inferencepools', 'tiny') is None, what='the pool deleted with the field')
        wait_for(lambda: 'inferencePool' not in cluster.status('tiny'), what='status.inferencePool cleared')
        cluster.patch_spec('tiny', {'routing': ROUTING})
        wait_for(lambda: kube_emulator.get('inferencepools', 'tiny'), what='the pool again')
        cluster.delete('tiny')
        wait_for(lambda: cluster.stage('tiny') is None, what='the stage to go')
        assert kube_emulator.get('inferencepools', 'tiny') is None, 'garbage-collected with the stage'
    assert denied_calls(kube_emulator) == []


def _dra_world(kube_emulator, devices: int) -> None:
    """A node whose GPUs come from a DRA driver: no nvidia.com/gpu allocatable, `devices` in its ResourceSlice."""
    kube_emulator.seed('nodes', {'metadata': {'name': 'dra-node'}, 'status': {'allocatable': {'cpu': '64'}}})
    kube_emulator.seed('deviceclasses', {'metadata': {'name': 'gpu'}, 'spec': {'selectors': [
        {'cel': {'expression': f"device.driver == '{DRIVER}'"}}]}})
    kube_emulator.seed('resourceslices', {'metadata': {'name': 'dra-node-gpus'}, 'spec': {
        'driver': DRIVER, 'nodeName': 'dra-node', 'pool': {'name': 'dra-node', 'generation': 1, 'resourceSliceCount': 1},
        'devices': [{'name': f'gpu-{i}'} for i in range(devices)]}})
    for name, count in (('two-gpus', 2), ('eight-gpus', 8)):
        kube_emulator.seed('resourceclaimtemplates', {'metadata': {'name': name}, 'spec': {'spec': {'devices': {
            'requests': [{'name': 'gpus', 'exactly': {'deviceClassName': 'gpu', 'count': count}}]}}}})


def dra_stage(name: str, gpus: int, template: str) -> dict:
    return manifest(name, replicas=1, parallel={'dataParallelSize': gpus},
                    resources={'gpusPerPod': gpus, 'gpuResourceName': 'nvidia.com/gpu'},
                    podTemplate={'resourceClaims': [{'name': 'gpus', 'resourceClaimTemplateName': template}]})


def test_dra_resource_slices_admit_a_stage_that_fits_and_refuse_one_that_does_not(cluster, kube_emulator):
    _dra_world(kube_emulator, devices=4)
    with operator(kube_emulator):
        cluster.apply(dra_stage('fits', 2, 'two-gpus'))
        cluster.apply(dra_stage('too-big', 8, 'eight-gpus'))
        pod = wait_for(lambda: cluster.pods('fits').get('fits-0'), what='the fitting stage\'s pod')
        assert pod['spec']['resourceClaims'] == [{'name': 'gpus', 'resourceClaimTemplateName': 'two-gpus'}]
        accepted = wait_for(lambda: cluster.condition('fits', 'Accepted'), what='the fitting stage decided')
        assert accepted['status'] == 'True'                               # written after the pod's create
        refused = wait_for(lambda: cluster.condition('too-big', 'Accepted'), what='the big one decided')
        assert (refused['status'], refused['reason']) == ('False', 'InsufficientGPUCapacity')
        assert refused['message'] == (
            'gpusPerPod=8 of nvidia.com/gpu fits no schedulable node: the largest is dra-node with 0 allocatable; '
            "nor the pod's resourceClaims: 8 device(s) of DeviceClass gpu (driver gpu.example.com) in "
            'ResourceSlices: the most on one schedulable node is dra-node with 4')
        assert cluster.pods('too-big') == {}
    assert denied_calls(kube_emulator) == []
