"""Run the real operator (kopf, KopfRunner) against the emulated API; play the kubelet and the scheduler."""
from __future__ import annotations

import contextlib
import copy
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
from support.kube_emulator import KubeEmulator

STAGES_PATH = '/apis/diffstage.io/v1alpha1/namespaces/default/diffusionstages'
MERGE = {'Content-Type': 'application/merge-patch+json'}
TINY = {'model': {'builtin': 'tiny-sd'}, 'replicas': 2, 'parallel': {'cfgParallelSize': 2},
        'resources': {'gpusPerPod': 2, 'gpuResourceName': ''}, 'engine': {'executionMode': 'step', 'maxNumSeqs': 4}}


def manifest(name: str, **spec: Any) -> dict[str, Any]:
    return {'apiVersion': 'diffstage.io/v1alpha1', 'kind': 'DiffusionStage', 'metadata': {'name': name},
            'spec': {**copy.deepcopy(TINY), **spec}}


def wait_for(condition: Callable[[], Any], timeout: float = 20, what: str = 'condition') -> Any:
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f'timed out waiting for {what}'
        time.sleep(0.05)
    return result


@contextlib.contextmanager
def operator(emulator: KubeEmulator, *scope: str) -> Iterator[Any]:
    """The operator in a thread (KopfRunner), by default serving the default namespace without peering;
    fails the test if it crashed."""
    import kopf
    from kopf.testing import KopfRunner

    # kopf registers handlers in a process-global registry when their module is imported: give this run a
    # fresh one (and a fresh import), and leave the previous one as it was for other kopf tests.
    saved, fresh = kopf.get_default_registry(), kopf.OperatorRegistry()
    kopf.on.login(registry=fresh)(kopf.login_via_client)  # what kopf's own default registry starts with
    kopf.set_default_registry(fresh)
    sys.modules.pop('stage_operator.handlers', None)
    args = ['run', '-m', 'stage_operator.handlers', *(scope or ('--namespace=default', '--standalone'))]
    try:
        with KopfRunner(args, timeout=60) as runner:
            wait_for(lambda: emulator.watching('diffusionstages') and emulator.watching('pods'), what='the watches')
            yield runner
    finally:
        kopf.set_default_registry(saved)
        sys.modules.pop('stage_operator.handlers', None)
    assert runner.exception is None, runner.output
    assert runner.exit_code == 0, runner.output
    assert 'Traceback' not in runner.output, runner.output


class Cluster:
    """The test's hands: kubectl (HTTP), the kubelet and the scheduler, all through the emulated API."""

    def __init__(self, emulator: KubeEmulator):
        self.emulator = emulator
        self.http = httpx.Client(base_url=emulator.base_url, timeout=10)

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        response = self.http.post(STAGES_PATH, json=obj)
        assert response.status_code == 201, response.text
        return response.json()

    def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        response = self.http.patch(f'{STAGES_PATH}/{name}', headers=MERGE, json={'spec': spec})
        assert response.status_code == 200, response.text

    def scale(self, name: str, replicas: int) -> None:
        response = self.http.patch(f'{STAGES_PATH}/{name}/scale', headers=MERGE, json={'spec': {'replicas': replicas}})
        assert response.status_code == 200, response.text

    def delete(self, name: str) -> None:
        assert self.http.delete(f'{STAGES_PATH}/{name}').status_code == 200

    def stage(self, name: str) -> dict[str, Any] | None:
        return self.emulator.get('dstage', name)

    def status(self, name: str) -> dict[str, Any]:
        return (self.stage(name) or {}).get('status') or {}

    def condition(self, name: str, kind: str) -> dict[str, Any]:
        return next((c for c in self.status(name).get('conditions', ()) if c['type'] == kind), {})

    def pods(self, stage: str) -> dict[str, dict[str, Any]]:
        return {p['metadata']['name']: p for p in self.emulator.objects('pods', 'default')
                if p['metadata'].get('labels', {}).get('diffstage.io/stage') == stage}

    def kubelet_ready(self, pod: str, ready: bool = True) -> None:
        """Scheduled, started, probes passing (or not)."""
        status = {'phase': 'Running', 'conditions': [
            {'type': 'PodScheduled', 'status': 'True'}, {'type': 'Ready', 'status': 'True' if ready else 'False'}],
            'containerStatuses': [{'name': 'stage', 'ready': ready, 'restartCount': 0,
                                   'state': {'running': {'startedAt': '2026-01-01T00:00:00Z'}}}]}
        self._pod_status(pod, status)

    def kubelet_failed(self, pod: str, exit_code: int, message: str) -> None:
        status = {'phase': 'Failed', 'conditions': [{'type': 'Ready', 'status': 'False'}],
                  'containerStatuses': [{'name': 'stage', 'ready': False, 'restartCount': 0, 'state': {'terminated': {
                      'exitCode': exit_code, 'reason': 'Error', 'message': message,
                      'finishedAt': '2026-01-01T00:01:00Z'}}}]}
        self._pod_status(pod, status)

    def scheduler_unschedulable(self, pod: str, message: str) -> None:
        self._pod_status(pod, {'phase': 'Pending', 'conditions': [
            {'type': 'PodScheduled', 'status': 'False', 'reason': 'Unschedulable', 'message': message}]})

    def _pod_status(self, pod: str, status: dict[str, Any]) -> None:
        response = self.http.patch(f'/api/v1/namespaces/default/pods/{pod}/status', headers=MERGE,
                                   json={'status': {'conditions': None, 'containerStatuses': None}})
        assert response.status_code == 200, response.text
        response = self.http.patch(f'/api/v1/namespaces/default/pods/{pod}/status', headers=MERGE, json={'status': status})
        assert response.status_code == 200, response.text

    def all_ready(self, stage: str) -> None:
        for name in self.pods(stage):
            self.kubelet_ready(name)

    def add_gpu_node(self, name: str, gpus: int, resource: str = 'nvidia.com/gpu') -> None:
        self.emulator.seed('nodes', {'metadata': {'name': name}, 'status': {'allocatable': {resource: str(gpus)}}})
