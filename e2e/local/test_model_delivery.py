"""Tier 4, model delivery (issue 18): one local cluster, one tiny SD pipeline tarred once, served by an HTTP
file server on loopback that this test starts. Through the real operator and the pod runner:

- `source.uri` + the right sha256 + a hostPath cache → Ready, serves; a second replica on the same
  (emulated) node starts from the cache: the server's access log shows one GET for both; the stage's deletion
  leaves no process and the cache unlocked (evictable);
- a wrong sha256 → lastFailure names the checksum mismatch, the replica goes through backoff and restarts
  (not a hang);
- `source.pvc` and `source.image` (an image volume, and the init-container copy out of the image) serve the
  same pipeline, bitwise the same images for one seed;
- a stage not ready within `startupTimeoutSeconds` fails with StartupTimeout naming the budget and the phase.

Each test stands alone, in any order: its own stages (deleted at its end) and, where a cache matters, a node
cache path of its own (a cold start is a cold start whatever ran before).
"""
from __future__ import annotations

import hashlib
import shutil
import sys
import tarfile

import pytest

from e2e import scenario
from e2e.file_server import FileServer
from e2e.local.cluster import LocalCluster

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith('linux'),
                       reason='the local pod runner gives each pod a 127.x.y.z address and reads /proc: Linux only'),
    pytest.mark.timeout(300),
]
IMAGE = 'registry.local/tiny-sd-model:1'
CACHE = '/var/cache/diffstage-e2e'


@pytest.fixture(scope='module')
def model(tmp_path_factory):
    """The tiny pipeline, as a folder and as a tar.gz (served under two names: one per checksum case)."""
    from stage_runtime.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp('model')
    folder = make_tiny_model(root / 'tiny-sd', kind='sd', seed=0)
    served = root / 'served'
    served.mkdir()
    with tarfile.open(served / 'tiny-sd.tar.gz', 'w:gz') as tar:
        tar.add(folder, arcname='tiny-sd')
    shutil.copy(served / 'tiny-sd.tar.gz', served / 'tiny-sd-copy.tar.gz')
    return {'folder': folder, 'served': served,
            'sha256': hashlib.sha256((served / 'tiny-sd.tar.gz').read_bytes()).hexdigest()}


@pytest.fixture(scope='module')
def server(model):
    with FileServer(model['served']) as files:
        yield files


@pytest.fixture(scope='module')
def cluster(tmp_path_factory, model):
    with LocalCluster(tmp_path_factory.mktemp('delivery-cluster')) as local:
        claim = tmp_path_factory.mktemp('claim')
        shutil.copytree(model['folder'], claim / 'sd' / 'tiny')       # a bound claim holding the pipeline
        image = tmp_path_factory.mktemp('image')
        shutil.copytree(model['folder'], image / 'models')            # an image with it at /models
        local.runner.sources.claims['models'] = claim
        local.runner.sources.images[IMAGE] = image
        yield local
    log = local.operator_log
    assert local.operator.returncode == 0, log[-3000:]
    assert 'Traceback' not in log, log[-5000:]
    assert not local.runner.errors, local.runner.errors


def manifest(name: str, model: dict, replicas: int = 1, **spec) -> dict:
    return {'apiVersion': 'diffstage.io/v1alpha1', 'kind': 'DiffusionStage', 'metadata': {'name': name},
            'spec': {'model': model, 'replicas': replicas, 'resources': {'gpusPerPod': 1, 'gpuResourceName': ''},
                     'healthCheck': {'periodSeconds': 0.5},
                     'restartPolicy': {'backoffInitialSeconds': 1, 'backoffMaxSeconds': 2}, **spec}}


PHASES = {'fetching', 'loadingWeights', 'warmup'}


def startup_seconds(cluster, name: str, index: int) -> dict | None:
    """Once every phase is in: the kubelet's fetch time comes with Ready, the stage's with the next probe."""
    took = replica(cluster, name, index).get('startupSeconds') or {}
    return took if set(took) == PHASES else None


def replica(cluster, name: str, index: int) -> dict:
    return next((r for r in scenario.status(cluster, name).get('replicaStatuses') or () if r['index'] == index), {})


def events(cluster, reason: str) -> list[str]:
    items = cluster.api.get(f'/api/v1/namespaces/{cluster.namespace}/events').json()['items']
    return [e['message'] for e in items if e.get('reason') == reason]


def cached_uri(server, model, cache: str) -> dict:
    uri = {'url': server.url('tiny-sd.tar.gz'), 'sha256': model['sha256']}
    return {'source': {'uri': uri}, 'cache': {'hostPath': cache, 'maxBytes': 10 ** 9}}


def test_a_checksummed_uri_serves_a_second_replica_from_the_cache_and_its_deletion_unlocks_it(cluster, server, model):
    # step 1: the first replica fetches (one GET) into a node cache of its own, becomes Ready and serves
    gets = server.gets('tiny-sd.tar.gz')
    cluster.apply(manifest('fetched', cached_uri(server, model, f'{CACHE}-fetched')))
    scenario.wait_ready(cluster, 'fetched', 1, timeout=150)
    image = scenario.generate(cluster, 'fetched', seed=7)
    assert server.gets('tiny-sd.tar.gz') == gets + 1
    cold = scenario.wait_for(lambda: startup_seconds(cluster, 'fetched', 0), 30, 'startupSeconds',
                             lambda: scenario.status(cluster, 'fetched'))
    status_model = scenario.wait_for(lambda: scenario.status(cluster, 'fetched').get('model', {}).get('sizeBytes')
                                     and scenario.status(cluster, 'fetched')['model'], 30, 'status.model sizes')
    url = server.url('tiny-sd.tar.gz')
    assert status_model['source'] == f'uri:{url}' and status_model['digest'] == f'sha256:{model["sha256"]}'
    assert status_model['sizeBytes'] > 100_000 and status_model['loadSeconds'] > 0, status_model
    assert any(m.startswith('fetched-0 ready after fetching ') for m in events(cluster, 'ReplicaReady'))
    # step 2: a second replica on the same node starts from the cache: still one GET for both
    scenario.scale(cluster, 'fetched', 2, timeout=150)
    assert server.gets('tiny-sd.tar.gz') == gets + 1, f'one GET for two replicas: {server.access_log}'
    cached = scenario.wait_for(lambda: startup_seconds(cluster, 'fetched', 1), 30, 'startupSeconds',
                               lambda: scenario.status(cluster, 'fetched'))
    print(f'\nstartup seconds: cold {cold}  cached {cached}')
    pods = {p['metadata']['name']: p for p in cluster.pods('fetched')}
    fetch = pods['fetched-1']['status']['initContainerStatuses'][0]
    assert fetch['name'] == 'fetch-model' and fetch['state']['terminated']['exitCode'] == 0
    for _ in range(2):  # round robin over both replicas: the same pipeline, the same image
        assert scenario.generate(cluster, 'fetched', seed=7) == image
    # step 3: the deletion leaves no process, and the cache both replicas used unlocked
    from stage_runtime.fetch.cache import ModelCache

    scenario.delete(cluster, 'fetched', 30)
    scenario.wait_for(lambda: not cluster.runner.running(), 60, 'every pod process to stop', cluster.runner.running)
    assert not cluster.runner.leftovers, cluster.runner.leftovers
    cache = ModelCache(cluster.runner.sources.node_root / f'{CACHE}-fetched'.lstrip('/'))
    assert len(cache.entries()) == 1
    assert len(cache.evict(0, grace_s=0).removed) == 1, 'no stage holds the model any more: it can go'


def test_a_wrong_checksum_ends_in_last_failure_and_backoff(cluster, server, model):
    wrong = '0' * 64
    uri = {'url': server.url('tiny-sd-copy.tar.gz'), 'sha256': wrong}
    cluster.apply(manifest('badsum', {'source': {'uri': uri}}))
    failure = scenario.wait_for(lambda: replica(cluster, 'badsum', 0).get('lastFailure'), 90, 'lastFailure',
                                lambda: scenario.status(cluster, 'badsum'))
    assert failure['reason'] == 'ChecksumMismatch' and failure['exitCode'] == 4, failure
    assert wrong in failure['message'] and model['sha256'] in failure['message'], failure
    scenario.wait_for(lambda: (scenario.status(cluster, 'badsum').get('restarts') or {}).get('total', 0) >= 1, 30,
                      'a restart after the backoff', lambda: scenario.status(cluster, 'badsum'))
    assert any('ChecksumMismatch (exit code 4)' in m and 'restarting in 1s' in m for m in events(cluster, 'RestartBackoff'))
    assert any('ChecksumMismatch' in m for m in events(cluster, 'ReplicaFailed')), 'Degraded said so while it lasted'
    scenario.delete(cluster, 'badsum', 30)


def test_pvc_and_image_sources_serve_the_same_pipeline(cluster, server, model):
    stages = {'from-pvc': {'source': {'pvc': {'claimName': 'models', 'subPath': 'sd/tiny'}}},
              'from-image-volume': {'source': {'image': {'reference': IMAGE}}, 'imageVolume': 'always'},
              'from-image-copy': {'source': {'image': {'reference': IMAGE}}, 'imageVolume': 'never'}}
    stages['from-uri'] = cached_uri(server, model, f'{CACHE}-sources')
    for name, source in stages.items():
        cluster.apply(manifest(name, source))
    for name in stages:
        scenario.wait_ready(cluster, name, 1, timeout=180)
    copied = cluster.pods('from-image-copy')[0]['status']['initContainerStatuses'][0]
    assert copied['name'] == 'copy-model' and copied['state']['terminated']['exitCode'] == 0
    image = scenario.generate(cluster, 'from-uri', seed=7)
    del stages['from-uri']
    for name in stages:
        assert scenario.generate(cluster, name, seed=7) == image, f'{name} serves the same pipeline as the uri'
        assert scenario.status(cluster, name)['model']['source'].startswith(('pvc:models/sd/tiny', f'image:{IMAGE}'))
    for name in (*stages, 'from-uri'):
        scenario.delete(cluster, name, 30)


def test_a_stage_not_ready_within_its_startup_budget_fails_saying_so(cluster):
    # healthCheck at its default period: the operator's own "no answer" verdict (3 probes) comes well after
    # the pod runner reports the exited stage, so lastFailure carries the stage's words
    slow = manifest('slow', {'source': {'pvc': {'claimName': 'models', 'subPath': 'sd/tiny'}}},
                    startupTimeoutSeconds=2)
    del slow['spec']['healthCheck']
    cluster.apply(slow)
    failure = scenario.wait_for(lambda: replica(cluster, 'slow', 0).get('lastFailure'), 90, 'lastFailure',
                                lambda: scenario.status(cluster, 'slow'))
    assert failure['reason'] == 'StartupTimeout', failure
    assert 'not ready within the startup budget of 2 s' in failure['message'], failure
    assert 'spec.startupTimeoutSeconds' in failure['message'] and ' for ' in failure['message'], failure
    scenario.delete(cluster, 'slow', 30)
