"""Tier 4, the video sample: `manifests/samples/tiny-wan.yaml` as shipped (one CPU rank, the built-in tiny Wan 2.1
that the pod's init container builds) on the embedded local cluster becomes Ready and serves a video through its
Service: an MP4 that plays the asked frames, and the same clip's exact frames."""
from __future__ import annotations

import io
import sys
import zipfile

import httpx
import pytest
import yaml

from e2e import scenario
from e2e.local.cluster import LocalCluster
from stage_runtime.videoio import decode_mp4

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith('linux'),
                       reason='the local pod runner gives each pod a 127.x.y.z address and reads /proc: Linux only'),
    pytest.mark.timeout(300),
]
MANIFEST = yaml.safe_load((scenario.ROOT / 'manifests' / 'samples' / 'tiny-wan.yaml').read_text())
NAME = MANIFEST['metadata']['name']


def test_the_video_sample_becomes_ready_and_serves_a_video(tmp_path):
    with LocalCluster(tmp_path / 'cluster') as cluster:
        cluster.apply(MANIFEST)
        scenario.restore(cluster, MANIFEST, 180)
        url = scenario.wait_for(lambda: cluster.service_url(NAME), 30, f'an endpoint behind Service {NAME}')
        body = {'prompt': 'a fox', 'size': '32x32', 'num_frames': 9, 'num_inference_steps': 3, 'seed': 1, 'fps': 8}
        clip = httpx.post(f'{url}/v1/videos/sync', json=body, timeout=120)
        frames = httpx.post(f'{url}/v1/videos/sync', json={**body, 'response_format': 'frames'}, timeout=120)
        assert clip.status_code == 200 and clip.headers['content-type'] == 'video/mp4', clip.text[:500]
        decoded, fps = decode_mp4(clip.content)
        assert decoded.shape == (9, 32, 32, 3) and fps == 8
        with zipfile.ZipFile(io.BytesIO(frames.content)) as archive:
            assert len(archive.namelist()) == 9
        status = scenario.status(cluster, NAME)
        assert status['phase'] == 'Ready' and status['readyReplicas'] == 1
    assert cluster.operator.returncode == 0, cluster.operator_log[-3000:]
    assert not cluster.leftovers(), cluster.leftovers()
