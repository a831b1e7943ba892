"""Tier 4, `spec.sleep` and `spec.profiling` on the embedded local cluster (issue 46): a tiny SD stage with
`afterIdle: 5s` sleeps by itself, stays Ready, its status counts it asleep; a request through its Service wakes it and
is answered 200; a profile started through the Service writes the pod's trace into the profiling volume."""
from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from e2e import scenario
from e2e.local.cluster import LocalCluster

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith('linux'),
                       reason='the local pod runner gives each pod a 127.x.y.z address and reads /proc: Linux only'),
    pytest.mark.timeout(300),
]
NAME = 'sleepy'
MANIFEST = {'apiVersion': 'diffstage.io/v1alpha1', 'kind': 'DiffusionStage', 'metadata': {'name': NAME},
            'spec': {'model': {'builtin': 'tiny-sd'}, 'replicas': 1,
                     'resources': {'gpusPerPod': 1, 'gpuResourceName': ''}, 'healthCheck': {'periodSeconds': 0.5},
                     'sleep': {'afterIdle': '5s', 'level': 2}, 'profiling': {'maxSeconds': 60}}}


def test_an_idle_replica_sleeps_stays_ready_and_a_request_through_the_service_wakes_it(tmp_path):
    with LocalCluster(tmp_path / 'cluster') as cluster:
        cluster.apply(MANIFEST)
        scenario.wait_ready(cluster, NAME, 1, timeout=240)
        scenario.wait_for(lambda: scenario.status(cluster, NAME).get('sleepingReplicas') == 1, 90,
                          'the replica asleep in the status', lambda: scenario.status(cluster, NAME))
        assert scenario.is_ready(cluster, NAME, 1)                   # asleep is still Ready: the Service routes to it
        url = scenario.wait_for(lambda: cluster.service_url(NAME), 30, f'an endpoint behind Service {NAME}')
        assert httpx.get(f'{url}/is_sleeping', timeout=10).json() == {'is_sleeping': True, 'level': 2}
        scenario.generate(cluster, NAME, timeout=120)                # 200 and a PNG: the request woke it
        assert httpx.get(f'{url}/v1/stats', timeout=10).json()['sleep']['wakes_total'] >= 1

        started = httpx.post(f'{url}/start_profile', timeout=60)
        assert started.status_code == 200, started.text
        scenario.generate(cluster, NAME, timeout=120)
        stopped = httpx.post(f'{url}/stop_profile', timeout=60)
        assert stopped.status_code == 200, stopped.text
        (trace,) = stopped.json()['files']
        assert Path(trace['path']).is_file() and trace['bytes'] > 0, trace
        scenario.delete(cluster, NAME, 90)
    assert cluster.operator.returncode == 0, cluster.operator_log[-3000:]
    assert not cluster.leftovers(), cluster.leftovers()
