"""Tier 4, video jobs on an object store outlive their pods (issue 47), on the embedded local cluster: a two-replica
tiny Wan stage whose `spec.jobs.objectStore` is a bucket of a real S3 server (moto, its own process on loopback), its
credentials from a Secret the pods get as their AWS environment; the official `openai` SDK through the Service.

- `client.videos.create_and_poll` through the Service completes (it also measures a step's pace here).
- Kill -9 the pod running a job at a random step: the job completes on the other replica, resumed from its last
  checkpoint in the bucket (its run history says where), and its frames equal an uninterrupted run's within 2 uint8.
"""
from __future__ import annotations

import base64
import json
import os
import random
import signal
import sys
import uuid

import httpx
import pytest
from support.s3_server import FAKE_CREDENTIALS, S3Server

from e2e import scenario
from e2e.local.cluster import LocalCluster
from e2e.local.test_local_cluster_job_failover import (FIELDS, SIZE, frames_of, live, pod_of, sdk, serve_pid,
                                                       steps_lasting, zip_frames)

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith('linux'),
                       reason='the local pod runner gives each pod a 127.x.y.z address and reads /proc: Linux only'),
    pytest.mark.timeout(420),
]
NAME = 'wan-failover'                      # the helpers read the stage by this name
SECRET = 'jobs-s3'
PREFIX = 'stages/failover'


@pytest.fixture(scope='module')
def s3(tmp_path_factory):
    server = S3Server(tmp_path_factory.mktemp('s3') / 'moto.log').start()
    yield server
    server.stop()


@pytest.fixture(scope='module')
def bucket(s3) -> str:
    return s3.make_bucket(f'failover-{uuid.uuid4().hex[:12]}')


@pytest.fixture(scope='module')
def manifest(s3, bucket) -> dict:
    spec = {'model': {'builtin': 'tiny-wan'}, 'replicas': 2, 'resources': {'gpusPerPod': 1, 'gpuResourceName': ''},
            'engine': {'executionMode': 'step', 'maxNumSeqs': 1},
            'healthCheck': {'periodSeconds': 0.5, 'timeoutSeconds': 10, 'failureThreshold': 20},
            'jobs': {'objectStore': {'bucket': bucket, 'prefix': PREFIX, 'endpoint': s3.endpoint,
                                     'credentialsSecret': SECRET},
                     'leaseSeconds': 4, 'checkpointEverySteps': 1}}
    return {'apiVersion': 'diffstage.io/v1alpha1', 'kind': 'DiffusionStage', 'metadata': {'name': NAME}, 'spec': spec}


@pytest.fixture(scope='module')
def cluster(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp('local-cluster-failover-s3')) as local:
        local.emulator.seed('secrets', {'metadata': {'name': SECRET}, 'type': 'Opaque', 'data': {
            key: base64.b64encode(value.encode()).decode() for key, value in FAKE_CREDENTIALS.items()
            if key.startswith('AWS_ACCESS') or key.startswith('AWS_SECRET')}})
        yield local
        local.delete(NAME)
        scenario.wait_for(lambda: local.stage(NAME) is None and not local.pods(NAME), 120, 'the stage gone')
    assert local.operator.returncode == 0, local.operator_log[-3000:]
    assert 'Traceback' not in local.operator_log, local.operator_log[-5000:]
    assert not local.leftovers(), local.leftovers()


def record(s3, bucket: str, job_id: str) -> dict:
    """The job's record as the bucket holds it (read straight from the store: no replica in between)."""
    try:
        body = s3.client().get_object(Bucket=bucket, Key=f'{PREFIX}/jobs/{job_id}/job.json')['Body']
    except s3.client().exceptions.NoSuchKey:
        return {}
    return json.loads(body.read())


def test_a_job_whose_pod_is_killed_resumes_on_the_other_replica_from_its_checkpoint_in_the_bucket(
        cluster, manifest, s3, bucket):
    scenario.restore(cluster, manifest, timeout=240)
    url = scenario.wait_for(lambda: cluster.service_url(NAME), 30, f'an endpoint behind Service {NAME}')
    with sdk(url) as client:                       # through the Service; it measures a step's pace here too
        calibration = client.videos.create_and_poll(prompt='a calibration fox', size=SIZE,
                                                    extra_body={**FIELDS, 'num_inference_steps': 100, 'seed': 1})
    assert calibration.status == 'completed', calibration
    [run] = calibration.diffstage['runs']
    pace = (run['ended_at'] - run['started_at']) / 100
    steps, kill_at = steps_lasting(pace, 3), random.randint(2, 8)
    fields = {**FIELDS, 'num_inference_steps': steps, 'seed': 11}
    with sdk(url) as client:
        video = client.videos.create(prompt='a fox in the snow', size=SIZE, extra_body=fields)
    running = scenario.wait_for(lambda: (r := record(s3, bucket, video.id)) and (r.get('checkpoint_step') or 0)
                                >= kill_at and r, 120, f'a checkpoint at step {kill_at}', poll=0.002)
    victim = pod_of(cluster, running['owner'])
    os.killpg(serve_pid(cluster, victim), signal.SIGKILL)               # the whole pod, every rank with it
    survivor = next(p['status']['podIP'] for p in live(cluster) if p['metadata']['name'] != victim)
    uninterrupted = httpx.post(f'http://{survivor}:8000/v1/videos/sync', timeout=300, json={
        'prompt': 'a fox in the snow', 'size': SIZE, **fields, 'response_format': 'frames'})
    assert uninterrupted.status_code == 200, uninterrupted.text[:500]
    done = scenario.wait_for(lambda: (r := record(s3, bucket, video.id)).get('status') in ('completed', 'failed')
                             and r, 240, f'{video.id} finished', lambda: record(s3, bucket, video.id))
    [lost, resumed] = done['runs']
    assert (lost['owner'], lost['outcome']) == (running['owner'], 'lease_expired'), done['runs']
    assert lost['to_step'] >= kill_at and resumed['owner'] != running['owner'], done['runs']
    assert kill_at <= resumed['from_step'] == done['resumed_from_step'] <= lost['to_step'], done['runs']
    assert (done['status'], resumed['outcome'], resumed['to_step']) == ('completed', 'completed', steps), done
    scenario.wait_ready(cluster, NAME, 2, timeout=240)                  # the killed pod is replaced
    with sdk(scenario.wait_for(lambda: cluster.service_url(NAME), 30, 'an endpoint')) as client:
        got = frames_of(client, video.id)
    expected = zip_frames(uninterrupted.content)
    assert got.shape == expected.shape == (17, 32, 32, 3)
    assert int(abs(got.astype(int) - expected).max()) <= 2
