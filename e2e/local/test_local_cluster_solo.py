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


MANIFEST = yaml.safe_load(SAMPLE.read_text())
NAME = MANIFEST['metadata']['name']


@pytest.fixture(scope='module')
def cluster(tmp_path_factory):
    assert 'extraArgs' not in MANIFEST['spec']['engine']
    with LocalCluster(tmp_path_factory.mktemp('solo-cluster')) as local:
        local.apply(MANIFEST)
        yield local
    assert local.operator.returncode == 0, local.operator_log[-3000:]
    assert 'Traceback' not in local.operator_log, local.operator_log[-5000:]
    assert not local.leftovers(), local.leftovers()


@pytest.fixture
def solo(cluster):
    """The sample as shipped, Ready, its adapter on the replica (whatever a test before changed); the cluster,
    the stage's name and its Service URL."""
    scenario.restore(cluster, MANIFEST, 180)
    url = scenario.wait_for(lambda: cluster.service_url(NAME), 30, f'an endpoint behind Service {NAME}')
    for adapter in httpx.get(f'{url}/v1/loras', timeout=30).json()['data']:      # a test's run-time adapters
        if adapter['name'] != 'ink':
            assert httpx.delete(f"{url}/v1/loras/{adapter['name']}", timeout=30).status_code in (200, 404)
    scenario.wait_for(lambda: replica_loras(cluster) == [['ink']], 60, 'the sample\'s adapter on the replica',
                      lambda: scenario.status(cluster, NAME))
    return cluster, NAME, url


def replica_loras(cluster) -> list[list[str] | None]:
    return [r.get('loras') for r in scenario.status(cluster, NAME).get('replicaStatuses') or ()]


def generate(url: str, **body) -> dict:
    response = httpx.post(f'{url}/v1/images/generations', timeout=120, json={
        'prompt': 'a lighthouse', 'size': '64x64', 'seed': 5, 'num_inference_steps': 4, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_the_startup_adapter_is_listed_in_status_and_changes_the_image(solo):
    cluster, name, url = solo
    assert scenario.status(cluster, name)['loraSync'] == {'applied': [{'name': 'ink', 'path': 'loras/ink',
                                                                       'pinned': True}], 'errors': []}
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



def test_a_changed_spec_loras_reaches_the_running_replica_without_a_restart_and_spares_run_time_adapters(solo):
    cluster, name, url = solo
    [before] = cluster.pods(name)
    mine = httpx.post(f'{url}/v1/loras', json={'name': 'mine', 'path': 'loras/ink'}, timeout=60)   # replica-local
    assert mine.status_code == 200, mine.text
    cluster.patch_spec(name, {'loras': [{'name': 'pixel', 'path': 'loras/pixel'}]})
    scenario.wait_for(lambda: replica_loras(cluster) == [['mine', 'pixel']], 60, 'pixel loaded, ink unloaded',
                      lambda: scenario.status(cluster, name))
    status = scenario.wait_for(lambda: (st := scenario.status(cluster, name)).get('loraSync', {}).get('applied') == [
        {'name': 'pixel', 'path': 'loras/pixel', 'pinned': True}] and st, 30, 'status.loraSync.applied')
    assert status['loraSync']['errors'] == [] and status['phase'] == 'Ready'
    [after] = cluster.pods(name)
    assert after['metadata']['uid'] == before['metadata']['uid']                       # the same pod: no roll
    assert after['status']['containerStatuses'][0]['restartCount'] == before['status']['containerStatuses'][0][
        'restartCount']
    generate(url, loras=[{'name': 'pixel'}], cache='off')
    gone = httpx.post(f'{url}/v1/images/generations', timeout=60, json={
        'prompt': 'x', 'size': '64x64', 'num_inference_steps': 2, 'loras': [{'name': 'ink'}]})
    assert gone.status_code == 400 and gone.json()['error']['param'] == 'loras.0.name'
    bad = {'name': 'ghost', 'path': 'loras/none'}                                       # a file no replica has
    cluster.patch_spec(name, {'loras': [{'name': 'pixel', 'path': 'loras/pixel'}, bad]})
    failed = scenario.wait_for(lambda: (st := scenario.status(cluster, name)).get('loraSync', {}).get('errors')
                               and st, 60, 'the refused adapter in status.loraSync.errors')
    assert 'ghost' in failed['loraSync']['errors'][0] and failed['loraSync']['applied'][-1]['name'] == 'pixel'


def pool_members(cluster) -> list[str]:
    """The InferencePool's endpoints by the endpoint picker's rule: Ready, labels match, not terminating."""
    from support.endpoint_picker import pool_members as members
    pool = cluster.emulator.get('inferencepools', NAME)
    return members(pool, cluster.pods(NAME)) if pool else []


def pod_url(cluster, index: int) -> str:
    pod = next(p for p in cluster.pods(NAME) if p['metadata']['name'] == f'{NAME}-{index}')
    return f"http://{pod['status']['podIP']}:8000"


async def test_cost_autoscaling_scales_out_and_the_inference_pool_drops_the_fenced_replica(solo):
    """spec.autoscaling.metric cost: one large request at a time (below maxNumSeqs 2, so `inflight` would hold at 1)
    is more outstanding pixel-steps than the target: the stage scales out to 2, and both replicas join the
    operator's InferencePool. Scaled back in while both are busy, the victim is fenced and drains: still Ready and
    not terminating, yet out of the pool (the picker's membership rule) and out of the Service."""
    cluster, name, url = solo
    target = 1_000_000                             # pixel-steps per replica: a 64x64 1000-step image is 4 M
    cluster.patch_spec(name, {
        'healthCheck': {'periodSeconds': 1},
        'routing': {'inferencePool': {'endpointPicker': {'name': 'epp'}}},
        'autoscaling': {'mode': 'Operator', 'minReplicas': 1, 'maxReplicas': 2, 'metric': 'cost',
                        'targetCostPerReplica': target, 'scaleUpStabilizationSeconds': 0,
                        'scaleDownStabilizationSeconds': 600}})
    scenario.wait_for(lambda: pool_members(cluster) == [f'{name}-0'], 60, 'the InferencePool over the replica',
                      lambda: cluster.emulator.get('inferencepools', name))
    pool = cluster.emulator.get('inferencepools', name)
    assert pool['spec']['selector']['matchLabels'] == cluster.emulator.get('services', name)['spec']['selector']
    stop, decided_stop = asyncio.Event(), asyncio.Event()
    async with httpx.AsyncClient(timeout=300) as http:
        loops = [asyncio.create_task(_busy(http, url, 'big', decided_stop))]    # one large request after another
        try:
            # (async waits from here on: the load runs on this event loop)
            decided = await async_wait_until(
                lambda: (a := scenario.status(cluster, name).get('autoscaling') or {}).get('desiredReplicas') == 2
                and a, 90, 'the cost autoscaler to want 2 replicas')
            assert decided['metric'] == 'cost' and decided['metricValue'] > target, decided
            assert decided['reason'].startswith('outstanding pixel-steps'), decided
            in_flight = (await http.get(f'{url}/v1/stats')).json()
            assert in_flight['waiting'] + in_flight['running'] <= 1 < 2   # maxNumSeqs 2: inflight keeps 1 replica
            # decided: the load ends (the 600 s scale-down window holds the 2), the new replica starts on idle cores
            decided_stop.set()
            await http.post(f'{pod_url(cluster, 0)}/v1/abort', json={'all': True})
            await async_wait_until(lambda: scenario.is_ready(cluster, name, 2), 180, 'two replicas Ready')
            await async_wait_until(lambda: pool_members(cluster) == [f'{name}-0', f'{name}-1'], 30, 'both in the pool')
            # both replicas kept busy (two requests at a time each); scaling in fences one, which then drains
            urls = [pod_url(cluster, 0), pod_url(cluster, 1)]
            loops += [asyncio.create_task(_busy(http, u, f'hold-{i}-{k}', stop)) for i, u in enumerate(urls)
                      for k in range(2)]
            for i, u in enumerate(urls):
                await async_wait_until(lambda u=u: _running(http, u), 60, f'replica {i} busy')
            cluster.patch_spec(name, {'autoscaling': {'targetCostPerReplica': 10 ** 12,
                                                      'scaleDownStabilizationSeconds': 0}})
            fenced = await async_wait_until(lambda: next((p for p in cluster.pods(name) if p['metadata']['labels'].get(
                'diffstage.io/serving') == 'false'), None), 60, 'a replica fenced by the scale-in')
            assert fenced['metadata']['name'] == f'{name}-1' and not fenced['metadata'].get('deletionTimestamp')
            assert any(c['type'] == 'Ready' and c['status'] == 'True' for c in fenced['status']['conditions'])
            assert pool_members(cluster) == [f'{name}-0']                 # out of the pool while it drains ...
            assert cluster.services.endpoints('default', name) == [urls[0]]   # ... as out of the Service
            assert await _running(http, urls[1]), 'it still runs its requests'
        finally:
            stop.set()
            decided_stop.set()
            for pod in cluster.pods(name):
                await http.post(f"http://{pod['status']['podIP']}:8000/v1/abort", json={'all': True})
            await asyncio.gather(*loops, return_exceptions=True)
    scenario.wait_for(lambda: len(cluster.pods(name)) == 1, 60, 'the drained replica to go')
    cluster.patch_spec(name, {'routing': None})
    scenario.wait_for(lambda: cluster.emulator.get('inferencepools', name) is None, 30, 'the pool deleted')


async def _busy(http: httpx.AsyncClient, base: str, tag: str, stop: asyncio.Event) -> None:
    """Large requests one after another until `stop` (each is 4 M pixel-steps, a few seconds here)."""
    body = {'prompt': tag, 'size': '64x64', 'num_inference_steps': 1000, 'cache': 'off'}
    n = 0
    while not stop.is_set():
        n += 1
        answer = await http.post(f'{base}/v1/images/generations', json={**body, 'request_id': f'{tag}-{n}'})
        assert answer.status_code in (200, 409), answer.text            # 409: aborted at the end


async def _running(http: httpx.AsyncClient, base: str) -> bool:
    rows = (await http.get(f'{base}/v1/requests')).json()['requests']
    return any(r['state'] == 'running' for r in rows)
