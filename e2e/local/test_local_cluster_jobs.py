"""Tier 4, `spec.jobs` on the embedded local cluster (issue 31, the operator): a two-replica tiny Wan stage whose
job store claim does not exist yet says Accepted=False JobsStoreMissing and has no pod; once the claim exists (in
the API, and bound to a folder on the node) both replicas start mounting it, and a video job made with the official
`openai` SDK through the Service is answered the same by each replica, its files in the claim's folder."""
from __future__ import annotations

import sys

import httpx
import openai
import pytest

from e2e import scenario
from e2e.local.cluster import LocalCluster

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith('linux'),
                       reason='the local pod runner gives each pod a 127.x.y.z address and reads /proc: Linux only'),
    pytest.mark.timeout(300),
]
NAME = 'wan-jobs'
MANIFEST = {'apiVersion': 'diffstage.io/v1alpha1', 'kind': 'DiffusionStage', 'metadata': {'name': NAME},
            'spec': {'model': {'builtin': 'tiny-wan'}, 'replicas': 2,
                     'resources': {'gpusPerPod': 1, 'gpuResourceName': ''},
                     'engine': {'executionMode': 'step', 'maxNumSeqs': 2}, 'healthCheck': {'periodSeconds': 0.5},
                     'jobs': {'claimName': 'video-jobs', 'leaseSeconds': 6, 'checkpointEverySteps': 1}}}
CLAIM = {'metadata': {'name': 'video-jobs'},
         'spec': {'accessModes': ['ReadWriteMany'], 'resources': {'requests': {'storage': '1Gi'}}}}
FIELDS = {'num_frames': 9, 'num_inference_steps': 3, 'seed': 5, 'fps': 8}


def test_a_missing_claim_is_reported_then_every_replica_serves_the_same_job_from_it(tmp_path):
    store = tmp_path / 'claim'
    store.mkdir()
    with LocalCluster(tmp_path / 'cluster') as cluster:
        cluster.apply(MANIFEST)
        missing = scenario.wait_for(lambda: scenario.condition(cluster, NAME, 'Accepted').get('reason')
                                    == 'JobsStoreMissing' and scenario.condition(cluster, NAME, 'Accepted'),
                                    30, 'Accepted=False JobsStoreMissing')
        assert missing['status'] == 'False' and 'video-jobs' in missing['message'], missing
        assert cluster.pods(NAME) == []
        cluster.runner.sources.claims['video-jobs'] = store          # the node's bound volume
        cluster.emulator.seed('persistentvolumeclaims', CLAIM)
        scenario.wait_ready(cluster, NAME, 2, timeout=240)
        url = scenario.wait_for(lambda: cluster.service_url(NAME), 30, f'an endpoint behind Service {NAME}')
        with openai.OpenAI(base_url=f'{url}/v1', api_key='unused', timeout=120) as client:
            video = client.videos.create_and_poll(prompt='a red fox', size='16x16', extra_body=FIELDS)
        assert (video.status, video.progress) == ('completed', 100), video
        ips = [p['status']['podIP'] for p in cluster.pods(NAME)]
        assert len(ips) == 2
        for ip in ips:                                                 # each replica, not only the Service
            answer = httpx.get(f'http://{ip}:8000/v1/videos/{video.id}', timeout=10)
            assert answer.status_code == 200 and answer.json()['status'] == 'completed', answer.text
        assert any(video.id in str(path) for path in store.rglob('*')), 'the job lives in the claim'
        cluster.delete(NAME)
        scenario.wait_for(lambda: cluster.stage(NAME) is None and not cluster.pods(NAME), 90, 'the stage gone')
    assert cluster.operator.returncode == 0, cluster.operator_log[-3000:]
    assert not cluster.leftovers(), cluster.leftovers()
