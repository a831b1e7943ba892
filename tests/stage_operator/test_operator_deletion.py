"""Deleting a stage: the real operator (kopf, in a thread) against the emulated API; the test plays kubelet, and two
real `stage-runtime serve` processes are the pods' containers at their own pod IPs where a request must be in
flight. A normal deletion, as a user sees it: the phase Terminating while the pods drain, no ERROR in the
operator's log, one change of the stage per real change (what `kubectl get -w` prints a row for), the request
answered. A drain that fails is an ERROR, and is retried."""
from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import kmock
import pytest
from support.live_pods import Generation, live_stages, map_pod, replica, wait_in_flight
from support.operator_harness import Cluster, manifest, operator, wait_for

from stage_operator.api.meta import PLURAL

ONE_RANK = {'parallel': {}, 'resources': {'gpusPerPod': 1, 'gpuResourceName': ''},
            'engine': {'executionMode': 'step', 'maxNumSeqs': 4},
            'healthCheck': {'periodSeconds': 0.25, 'timeoutSeconds': 1, 'failureThreshold': 3}}


@pytest.fixture
def cluster(kube_emulator, kubeconfig):
    c = Cluster(kube_emulator)
    yield c
    c.close()


class StageWatch(threading.Thread):
    """What `kubectl get dstage NAME -w` reads: every watch event of the stage after `since`, until DELETED."""

    def __init__(self, cluster: Cluster, name: str, since: str):
        super().__init__(daemon=True)
        self.url = f'{cluster.emulator.base_url}{cluster.stages_path()}'
        self.params = {'watch': 'true', 'fieldSelector': f'metadata.name={name}', 'resourceVersion': since,
                       'timeoutSeconds': '300'}
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.start()

    def run(self) -> None:
        with httpx.stream('GET', self.url, params=self.params, timeout=None) as response:
            for line in response.iter_lines():
                if line.strip():
                    event = json.loads(line)
                    self.events.append((event['type'], event['object']))
                    if event['type'] == 'DELETED':
                        return


def kopf_and_errors(lines: list[str]) -> list[str]:
    """Records at ERROR and above, and kopf's at WARNING and above."""
    return [line for line in lines if line.startswith(('ERROR', 'CRITICAL'))
            or (line.startswith('WARNING') and line.split()[1].startswith('kopf'))]


def test_deleting_a_stage_with_a_request_in_flight_drains_it_without_alarm(cluster, kube_emulator, tiny_sd_path,
                                                                           tmp_path):
    with live_stages(tiny_sd_path, tmp_path, 2) as (a, b), operator(kube_emulator) as op:
        cluster.apply(manifest('solo', **ONE_RANK))
        wait_for(lambda: len(cluster.pods('solo')) == 2, what='two pods')
        map_pod(cluster, 'solo-0', a.http_url)
        map_pod(cluster, 'solo-1', b.http_url)
        wait_for(lambda: cluster.status('solo').get('phase') == 'Ready'
                 and all(replica(cluster, 'solo', i).get('health') == 'Healthy' for i in (0, 1)), what='Ready, probed')
        call = Generation(a.http_url, 'in-flight', 150)
        wait_in_flight(a.http_url, 1, [call])
        wait_for(lambda: replica(cluster, 'solo', 0).get('running') == 1, what='the running request in status')
        watch = StageWatch(cluster, 'solo', cluster.stage('solo')['metadata']['resourceVersion'])
        kube_emulator.reset_counts()
        logged = len(op.output.splitlines())
        cluster.delete('solo')  # kubectl delete dstage solo --wait=false

        terminating = wait_for(lambda: cluster.status('solo').get('phase') == 'Terminating' and cluster.status('solo'),
                               what='phase Terminating')
        assert call.status is None, 'Terminating while its request still runs'
        assert terminating['reason'] == 'Draining'
        ready = next(c for c in terminating['conditions'] if c['type'] == 'Ready')
        assert (ready['status'], ready['reason']) == ('False', 'Terminating')
        wait_for(lambda: cluster.stage('solo') is None, timeout=120, what='the stage to go once drained')
        call.join(60)
        assert call.status == 200 and call.body['data'][0]['b64_json'], (call.status, call.body)
        watch.join(30)

        problems = kopf_and_errors(op.output.splitlines()[logged:])
        assert problems == [], '\n'.join(problems)
        status_writes = [m for m in kube_emulator.mutations if m[1] == PLURAL and m[4] == 'status']
        assert len(status_writes) <= 1 + 2, f'once when the drain starts, once per pod leaving: {status_writes}'
        # the rows `kubectl get -w` prints: the deletion itself, then one per real change, then the stage is gone
        rows = [(obj.get('status', {}).get('phase'), obj.get('status', {}).get('readyReplicas'))
                for kind, obj in watch.events if kind == 'MODIFIED']
        assert [kind for kind, _ in watch.events][-1] == 'DELETED', watch.events
        assert rows[0] == ('Ready', 2) and {phase for phase, _ in rows[1:]} == {'Terminating'}, rows
        counts = [count for _, count in rows[1:]]
        assert counts == sorted(set(counts), reverse=True) and counts[-1] == 0, f'each row a pod leaving: {rows}'


def test_a_failing_drain_is_an_error_in_the_log_and_is_retried(cluster, kube_emulator):
    kube_emulator['delete', kmock.resource('v1/pods')][:1] << 503  # the drain's first pod deletion fails
    with operator(kube_emulator) as op:
        cluster.apply(manifest('gone', **ONE_RANK, replicas=1))
        wait_for(lambda: 'gone-0' in cluster.pods('gone') and cluster.status('gone').get('replicas') == 1,
                 what='its pod, in status')
        cluster.delete('gone')
        wait_for(lambda: cluster.stage('gone') is None, what='the stage to go after the retry')
        assert cluster.pods('gone') == {}
    errors = [line for line in op.output.splitlines() if line.startswith('ERROR')]
    assert len(errors) == 1, errors
    assert errors[0].startswith(
        "ERROR kopf.objects: Handler 'stage_deleted' failed temporarily: draining default/gone failed: "
        "DELETE /api/v1/namespaces/default/pods/gone-0 answered 503"), errors
