"""DiffusionStage objects for the Argo CD health tests, recorded from the operator's own reconcile.

Each case is a stage spec plus what the cluster holds (pods in some state, nodes); `record(case)` runs the
real pure `reconcile` on it and returns the stage with the status the operator would write. The recorded
objects live in manifests/argocd/testdata/ (Argo CD's health_test.yaml layout, so the script can also be
proposed upstream); a test fails when they drift from what the operator writes today. Re-record with
`.venv/bin/python tests/manifests/health_cases.py --write`.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

from stage_operator.builders.pod import build_pod
from stage_operator.observed import Observed
from stage_operator.reconcile import reconcile
from stage_operator.stage import parse_stage

ROOT = Path(__file__).resolve().parents[2]
ARGOCD = ROOT / 'manifests' / 'argocd'
T0 = '2026-01-01T00:00:00Z'
TINY = yaml.safe_load((ROOT / 'manifests' / 'samples' / 'tiny-cpu.yaml').read_text())['spec']
POD_STATES = {
    'ready': {'phase': 'Running', 'podIP': '10.0.0.1', 'conditions': [{'type': 'Ready', 'status': 'True'}]},
    'starting': {'phase': 'Running', 'podIP': '10.0.0.1', 'conditions': [{'type': 'Ready', 'status': 'False'}]},
    'failed': {'phase': 'Failed', 'containerStatuses': [{'name': 'stage', 'restartCount': 0, 'state': {'terminated': {
        'exitCode': 3, 'reason': 'Error', 'message': 'WorkerDied: rank 1 (pid 4242) killed by signal 9',
        'finishedAt': T0}}}]},
    'invalid': {'phase': 'Failed', 'containerStatuses': [{'name': 'stage', 'restartCount': 0, 'state': {'terminated': {
        'exitCode': 2, 'reason': 'Error', 'message': 'ConfigError: unrecognized arguments: --bad',
        'finishedAt': T0}}}]},
}
# name: spec changes, pod states by index ('old:' = built from the sample's spec), nodes, a spec change after the
# status was written (bump), and the health Argo CD must show (message None: checked in the test)
CASES: dict[str, dict[str, Any]] = {
    'healthy': {'pods': ['ready', 'ready'], 'expect': ('Healthy', '2/2 replicas ready, world size 2')},
    'no-status': {'record': False, 'expect': ('Progressing', 'waiting for the operator to observe the stage')},
    'generation-not-observed': {'pods': ['ready', 'ready'], 'bump': {'replicas': 3},
                                'expect': ('Progressing', 'spec change not yet observed (generation 2, observed 1)')},
    'rolling-update': {'spec': {'engine': {'executionMode': 'step', 'maxNumSeqs': 8}},
                       'pods': ['old:ready', 'old:ready'],
                       'expect': ('Progressing', 'RollingUpdate: 0/2 replicas updated')},
    'scaling-up': {'spec': {'replicas': 3}, 'pods': ['ready', 'ready'],
                   'expect': ('Progressing', 'ReplicasStarting: 2/3 replicas ready')},
    'replica-restarting': {'pods': ['ready', 'failed'], 'expect': (
        'Progressing', 'ReplicaFailed: tiny-1: WorkerDied (exit code 3): rank 1 (pid 4242) killed by signal 9 '
                       '(1/2 replicas ready)')},
    'replica-failed': {'spec': {'replicas': 1}, 'pods': ['failed'], 'expect': (
        'Degraded', 'ReplicaFailed: tiny-0: WorkerDied (exit code 3): rank 1 (pid 4242) killed by signal 9 '
                    '(0/1 replicas ready)')},
    'stalled-invalid-spec': {'spec': {'resources': {'gpusPerPod': 3, 'gpuResourceName': ''}}, 'expect': (
        'Degraded', 'InvalidSpec: fix the spec; nothing is created until then')},
    'accepted-false-insufficient-gpus': {
        'spec': {'resources': {'gpusPerPod': 2, 'gpuResourceName': 'nvidia.com/gpu'}},
        'nodes': [{'metadata': {'name': 'n1'}, 'status': {'allocatable': {'nvidia.com/gpu': '1'}}}],
        'expect': ('Degraded', None)},
    'rollout-failed': {'spec': {'engine': {'executionMode': 'step', 'maxNumSeqs': 4, 'extraArgs': ['--bad']}},
                       'from_ready': True, 'pods': ['old:ready', 'invalid'], 'expect': ('Degraded', None)},
    'scaled-to-zero': {'spec': {'replicas': 0}, 'expect': ('Suspended', 'scaled to zero (spec.replicas: 0)')},
    'scaled-to-zero-by-autoscaler': {'spec': {'replicas': 0, 'autoscaling': {'mode': 'External'}},
                                     'expect': ('Healthy', 'scaled to zero by the autoscaler')},
    'deleting': {'pods': ['ready', 'ready'], 'deleting': True,
                 'expect': ('Progressing', 'Draining: the stage is being deleted: draining tiny-0, tiny-1')},
}


def _spec(changes: dict[str, Any]) -> dict[str, Any]:
    return {**copy.deepcopy(TINY), **copy.deepcopy(changes)}


def _stage(spec: dict[str, Any], generation: int = 1, status: dict[str, Any] | None = None,
           deleting: bool = False) -> dict[str, Any]:
    gone = {'deletionTimestamp': T0, 'finalizers': ['diffstage.io/operator']} if deleting else {}
    return {'apiVersion': 'diffstage.io/v1alpha1', 'kind': 'DiffusionStage',
            'metadata': {'name': 'tiny', 'namespace': 'default', 'uid': 'e2f1c7d4-0000-4000-8000-000000000001',
                         'generation': generation, 'creationTimestamp': T0, **gone},
            'spec': spec, **({'status': status} if status is not None else {})}


def _merged(target: Any, patch: Any) -> Any:
    """`target` with an RFC 7386 merge patch applied (what the API server stores)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merged(out.get(key), value)
    return out


def record(name: str) -> dict[str, Any]:
    case = CASES[name]
    spec = _spec(case.get('spec', {}))
    if not case.get('record', True):
        return _stage(spec)
    stage = parse_stage(_stage(spec))
    old = parse_stage(_stage(_spec({})))
    if case.get('from_ready'):  # a rollout from the sample, Ready on both replicas (its stable revision)
        ready = [build_pod(old, i) | {'status': copy.deepcopy(POD_STATES['ready'])} for i in range(2)]
        before = reconcile(old, Observed(pods=ready, now=T0)).status
        stage = parse_stage(_stage(spec, generation=2, status=before))
    pods = []
    for index, state in enumerate(case.get('pods', ())):
        built = build_pod(old if state.startswith('old:') else stage, index)
        built['metadata']['uid'] = f'pod-{index}'
        built['status'] = copy.deepcopy(POD_STATES[state.removeprefix('old:')])
        pods.append(built)
    plan = reconcile(stage, Observed(pods=pods, nodes=case.get('nodes'), now=T0))
    status = plan.status
    if case.get('from_ready'):
        status = {**before, **plan.status}
    if case.get('deleting'):  # `kubectl delete` of the stage just reconciled: its first reconcile while deleted
        stage = parse_stage(_stage(spec, status=status, deleting=True))
        status = _merged(status, reconcile(stage, Observed(pods=pods, now=T0)).status)
    obj = _stage(spec, generation=stage.generation, status=status, deleting=case.get('deleting', False))
    if bump := case.get('bump'):  # a sync after the status was written
        obj['spec'].update(bump)
        obj['metadata']['generation'] += 1
    return obj


def write() -> None:
    tests = []
    for name, case in CASES.items():
        path = ARGOCD / 'testdata' / f'{name}.yaml'
        path.write_text(yaml.safe_dump(record(name), sort_keys=False))
        status, message = case['expect']
        tests.append({'healthStatus': {'status': status, **({'message': message} if message else {})},
                      'inputPath': f'testdata/{name}.yaml'})
    header = '# Argo CD health_test.yaml layout; objects recorded by tests/manifests/health_cases.py --write\n'
    (ARGOCD / 'health_test.yaml').write_text(header + yaml.safe_dump({'tests': tests}, sort_keys=False))


if __name__ == '__main__':
    if sys.argv[1:] != ['--write']:
        sys.exit('usage: health_cases.py --write   (re-records manifests/argocd/testdata/)')
    write()
