"""Tier 4, the feature sample: `manifests/samples/tiny-solo.yaml` as shipped (one CPU rank, the built-in tiny
FLUX.1, spec.loras naming the demo adapter the built-in model ships, the block cache and priority scheduling
from CRD fields, no extraArgs) on the embedded local cluster. Each feature is used through the Service: the
adapter is loaded at startup and listed in status and changes the image; the block cache skips steps; a
high-priority request preempts a running low one and finishes first."""
from __future__ import annotations

import asyncio
import base64
import sys

import httpx
import pytest
import yaml
from support.waiting import async_wait_until

from e2e import scenario
from e2e.local.cluster import LocalCluster

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith('linux'),
                       reason='the local pod runner gives each pod a 127.x.y.z address and reads /proc: Linux only'),
    pytest.mark.timeout(300),
]
SAMPLE = scenario.ROOT / 'manifests' / 'samples' / 'tiny-solo.yaml'
LONG = 400          # steps of a low-priority request: it runs until the test is done with it


@pytest.fixture(scope='module')
def solo(tmp_path_factory):
    """The sample applied as shipped, Ready; its name and Service URL."""
    manifest = yaml.safe_load(SAMPLE.read_text())
    assert 'extraArgs' not in manifest['spec']['engine']
    name = manifest['metadata']['name']
    with LocalCluster(tmp_path_factory.mktemp('solo-cluster')) as cluster:
        cluster.apply(manifest)
        scenario.wait_ready(cluster, name, 1, timeout=180)
        url = scenario.wait_for(lambda: cluster.service_url(name), 30, f'an endpoint behind Service {name}')
        yield cluster, name, url
    assert cluster.operator.returncode == 0, cluster.operator_log[-3000:]
    assert 'Traceback' not in cluster.operator_log, cluster.operator_log[-5000:]
    assert not cluster.leftovers(), cluster.leftovers()


def generate(url: str, **body) -> dict:
    response = httpx.post(f'{url}/v1/images/generations', timeout=120, json={
        'prompt': 'a lighthouse', 'size': '64x64', 'seed': 5, 'num_inference_steps': 4, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_the_startup_adapter_is_listed_in_status_and_changes_the_image(solo):
    cluster, name, url = solo
    replicas = scenario.status(cluster, name)['replicaStatuses']
    scenario.wait_for(lambda: [r.get('loras') for r in scenario.status(cluster, name)['replicaStatuses']]
                      == [['ink']], 30, 'status.replicaStatuses[].loras', lambda: replicas)
    plain = generate(url, cache='off')['data'][0]['b64_json']
    inked = generate(url, cache='off', loras=[{'name': 'ink', 'scale': 1.0}])['data'][0]['b64_json']
    assert base64.b64decode(plain) != base64.b64decode(inked)


def test_the_block_cache_from_the_crd_skips_steps(solo):
    _, _, url = solo
    answer = generate(url, num_inference_steps=8, cache={'threshold': 10.0})       # skip whenever allowed
    cache = answer['cache']
    assert cache['steps_computed'] + cache['steps_skipped'] == 8 and cache['steps_skipped'] > 0, cache
    off = generate(url, num_inference_steps=8, cache='off').get('cache') or {}
    assert off.get('steps_skipped', 0) == 0, off


async def test_priority_scheduling_from_the_crd_preempts_a_low_request_for_a_high_one(solo):
    _, _, url = solo
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        lows = [asyncio.create_task(http.post('/v1/images/generations', json={
            'prompt': 'low', 'size': '64x64', 'num_inference_steps': LONG, 'priority': -5, 'request_id': rid,
            'cache': 'off'})) for rid in ('low-0', 'low-1')]
        async def both_running() -> bool:
            rows = (await http.get('/v1/requests')).json()['requests']
            return sum(r['state'] == 'running' and r['step'] >= 1 for r in rows) == 2

        await async_wait_until(both_running, 60, 'both low requests running (maxNumSeqs 2: the running set is full)')
        high = await http.post('/v1/images/generations', json={
            'prompt': 'high', 'size': '64x64', 'num_inference_steps': 4, 'priority': 100, 'cache': 'off'})
        assert high.status_code == 200, high.text
        rows = {r['request_id']: r for r in (await http.get('/v1/requests')).json()['requests']}
        assert set(rows) == {'low-0', 'low-1'}, rows                 # the high one finished first
        assert sum(r['preemptions'] for r in rows.values()) >= 1, rows
        aborted = (await http.post('/v1/abort', json={'request_ids': ['low-0', 'low-1']})).json()
        assert sorted(aborted['aborted']) == ['low-0', 'low-1']
        assert [(await low).status_code for low in lows] == [409, 409]

