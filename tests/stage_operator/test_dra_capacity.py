"""GPU capacity under DRA (pure): a node whose GPUs come from a DRA driver lists no extended resource; with
podTemplate.resourceClaims the check counts the devices of the claims' DeviceClass in the node's ResourceSlices.
A stage that fits is admitted; one that does not is refused with a message naming both sources and the numbers."""
from __future__ import annotations

import pytest

from stage_operator import dra
from stage_operator.api.spec import Resources
from stage_operator.capacity import check

DRIVER = 'gpu.example.com'
CLAIMS = [{'name': 'gpus', 'resourceClaimTemplateName': 'two-gpus'}]


def node(name: str, allocatable: dict | None = None, unschedulable: bool = False) -> dict:
    return {'metadata': {'name': name}, 'spec': {'unschedulable': unschedulable},
            'status': {'allocatable': {'cpu': '64', **(allocatable or {})}}}


def template(count: int, device_class: str = 'gpu', mode: str | None = None) -> dict:
    exactly = {'deviceClassName': device_class, 'count': count, **({'allocationMode': mode} if mode else {})}
    return {'apiVersion': 'resource.k8s.io/v1', 'kind': 'ResourceClaimTemplate', 'metadata': {'name': 'two-gpus'},
            'spec': {'spec': {'devices': {'requests': [{'name': 'g', 'exactly': exactly}]}}}}


def device_class(name: str = 'gpu', driver: str | None = DRIVER) -> dict:
    selectors = [{'cel': {'expression': f'device.driver == "{driver}" && device.attributes["{driver}"].type == "gpu"'}}]
    return {'metadata': {'name': name}, 'spec': {'selectors': selectors if driver else []}}


def resource_slice(node_name: str, devices: int, driver: str = DRIVER, generation: int = 1, pool: str = '') -> dict:
    return {'metadata': {'name': f'{node_name}-{driver}-{generation}'},
            'spec': {'driver': driver, 'nodeName': node_name,
                     'pool': {'name': pool or node_name, 'generation': generation, 'resourceSliceCount': 1},
                     'devices': [{'name': f'gpu-{i}'} for i in range(devices)]}}


def inventory(count: int, slices: list[dict], classes: list[dict] | None = None) -> dra.Inventory:
    return dra.Inventory({'gpus': template(count)}, classes if classes is not None else [device_class()], slices)


GPU = Resources(gpus_per_pod=2, gpu_resource_name='nvidia.com/gpu')
NODES = [node('dra-a'), node('dra-b')]                      # no nvidia.com/gpu: the GPUs are the DRA driver's
SLICES = [resource_slice('dra-a', 4), resource_slice('dra-b', 2)]


def test_a_node_without_the_extended_resource_admits_a_stage_its_slices_fit():
    assert check(GPU, NODES).ok is False                                 # the extended resource alone refuses
    assert check(GPU, NODES, CLAIMS, inventory(2, SLICES)).ok
    assert check(GPU, NODES, CLAIMS, inventory(4, SLICES)).ok            # dra-a has 4


def test_a_stage_no_node_fits_is_refused_naming_both_sources_and_the_numbers():
    fit = check(Resources(gpus_per_pod=8, gpu_resource_name='nvidia.com/gpu'), NODES, CLAIMS, inventory(8, SLICES))
    assert not fit.ok and fit.reason == 'InsufficientGPUCapacity' and fit.recheck == dra.RECHECK_SECONDS
    assert fit.message == (
        'gpusPerPod=8 of nvidia.com/gpu fits no schedulable node: the largest is dra-b with 0 allocatable; nor the '
        "pod's resourceClaims: 8 device(s) of DeviceClass gpu (driver gpu.example.com) in ResourceSlices: the most "
        'on one schedulable node is dra-a with 4')


def test_cpu_ranks_with_claims_check_the_slices_alone():
    fit = check(Resources(gpus_per_pod=1, gpu_resource_name=''), NODES, CLAIMS, inventory(6, SLICES))
    assert not fit.ok and fit.message == (
        "the pod's resourceClaims fit no schedulable node: 6 device(s) of DeviceClass gpu (driver gpu.example.com) "
        'in ResourceSlices: the most on one schedulable node is dra-a with 4')
    assert check(Resources(gpus_per_pod=1, gpu_resource_name=''), NODES).ok       # no claims: CPU ranks, no check


def test_either_source_fits():
    plugin = [node('plugin', {'nvidia.com/gpu': '2'})]
    assert check(GPU, plugin, CLAIMS, inventory(8, [])).ok                # the device plugin's node fits


@pytest.mark.parametrize('slices, classes, fits', [
    ([resource_slice('dra-a', 4, driver='other.example.com')], None, False),         # another driver's devices
    ([resource_slice('dra-a', 4, generation=1), resource_slice('dra-a', 1, generation=2)], None, False),  # stale
    ([resource_slice('dra-a', 2, pool='p'), resource_slice('dra-a', 2, pool='q')], None, True),  # two pools add up
    ([resource_slice('dra-a', 4, driver='other.example.com')], [device_class(driver=None)], True),  # any driver
], ids=['other-driver', 'older-generation-ignored', 'pools-add-up', 'class-without-driver-term'])
def test_which_devices_count(slices, classes, fits):
    assert check(GPU, [node('dra-a')], CLAIMS, inventory(4, slices, classes)).ok is fits


def test_unschedulable_nodes_and_missing_objects_are_named():
    fit = check(GPU, [node('dra-a', unschedulable=True), node('dra-b')], CLAIMS, inventory(4, SLICES))
    assert not fit.ok and 'the most on one schedulable node is dra-b with 2' in fit.message
    missing = check(GPU, NODES, CLAIMS, dra.Inventory({'gpus': None}, [device_class()], SLICES))
    assert not missing.ok and 'ResourceClaimTemplate two-gpus (resourceClaims gpus) not found' in missing.message
    no_class = check(GPU, NODES, CLAIMS, inventory(2, SLICES, classes=[]))
    assert not no_class.ok and 'DeviceClass gpu (named by the pod\'s resourceClaims) not found' in no_class.message


def test_a_shared_claim_and_allocation_mode_all_are_read():
    claim = {'kind': 'ResourceClaim', 'metadata': {'name': 'shared'},
             'spec': {'devices': {'requests': [{'name': 'g', 'exactly': {'deviceClassName': 'gpu', 'count': 3}}]}}}
    need, _ = dra.requested([{'name': 'c', 'resourceClaimName': 'shared'}], dra.Inventory({'c': claim}))
    assert need == {'gpu': 3}
    need, _ = dra.requested(CLAIMS, dra.Inventory({'gpus': template(0, mode='All')}))
    assert need == {'gpu': 1}
