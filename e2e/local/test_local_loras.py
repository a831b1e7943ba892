"""Tier 4, LoRA: a DiffusionStage with spec.loras on the embedded local cluster (the emulated API, the operator
as a real process, the pod as real local processes). The stage loads the adapters at startup, the replica's
status lists them (the operator's probe reads /v1/loras), and a request through the Service applies one.

The adapter files are random PEFT adapters for the built-in tiny SD (the pod builds the same model with
`make-tiny-model`, seed 0), on this machine's disk: the local pod runner's pods share it, as a volume would. (That a changed list rolls the pods is the template hash's job:
tests/stage_operator/builders/test_runtime_config.py; the roll itself is the operator's ordinary rollout.)
"""
from __future__ import annotations

import base64
import sys

import httpx
import pytest
from lora_probes import write_adapter

from e2e import scenario
from e2e.local.cluster import LocalCluster
from stage_runtime.models.tiny import make_tiny_model

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith('linux'),
                       reason='the local pod runner gives each pod a 127.x.y.z address and reads /proc: Linux only'),
    pytest.mark.timeout(300),
]
NAME = 'styled'


@pytest.fixture(scope='module')
def adapters(tmp_path_factory) -> dict[str, str]:
    work = tmp_path_factory.mktemp('lora-adapters')
    model = str(make_tiny_model(work / 'tiny-sd', kind='sd', seed=0))
    return {name: write_adapter(model, work / name, seed=seed) for name, seed in (('pixel', 1), ('ink', 2))}


@pytest.fixture(scope='module')
def cluster(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp('lora-cluster')) as local:
        yield local
    assert local.operator.returncode == 0, local.operator_log[-3000:]
    assert 'Traceback' not in local.operator_log, local.operator_log[-5000:]
    assert not local.runner.errors, local.runner.errors


def replica_loras(cluster) -> list[list[str] | None]:
    return [r.get('loras') for r in scenario.status(cluster, NAME).get('replicaStatuses') or ()]


def generate(cluster, **body) -> bytes:
    url = scenario.wait_for(lambda: cluster.service_url(NAME), 30, f'an endpoint behind Service {NAME}')
    response = httpx.post(f'{url}/v1/images/generations', timeout=120, json={
        'prompt': 'a lighthouse', 'size': '64x64', 'seed': 5, 'num_inference_steps': 3, **body})
    assert response.status_code == 200, response.text
    return base64.b64decode(response.json()['data'][0]['b64_json'])


def test_spec_loras_are_loaded_listed_in_status_and_used_through_the_service(cluster, adapters):
    manifest = scenario.with_spec(scenario.sample(), replicas=1, parallel={},
                                  resources={'gpusPerPod': 1, 'gpuResourceName': ''},
                                  loras=[{'name': 'pixel', 'path': adapters['pixel']},
                                         {'name': 'ink', 'path': adapters['ink'], 'pinned': False}])
    manifest['metadata']['name'] = NAME
    cluster.apply(manifest)
    scenario.wait_ready(cluster, NAME, 1, timeout=180)
    scenario.wait_for(lambda: replica_loras(cluster) == [['pixel', 'ink']], 30, 'status.replicaStatuses[].loras',
                      lambda: scenario.status(cluster, NAME))
    assert generate(cluster, loras=[{'name': 'pixel', 'scale': 1.0}]) != generate(cluster)
    scenario.delete(cluster, NAME, timeout=120)
