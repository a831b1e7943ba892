"""A pure reconcile's world for tests: a stage from a spec dict, its pods as a kubelet reports them, the children
as the operator built them, and `settle` (the stage after the plan's status was written)."""
from __future__ import annotations

import copy
from typing import Any

from e2e.local import kubelet
from stage_operator.builders.children import build_configmap, build_service
from stage_operator.builders.disruption import build_pdb
from stage_operator.builders.networkpolicy import build_network_policy
from stage_operator.builders.pod import build_pod
from stage_operator.observed import Observed
from stage_operator.reconcile import reconcile
from stage_operator.stage import parse_stage

T0, T1 = '2026-01-01T00:00:00Z', '2026-01-01T00:05:00Z'
IP = '127.100.0.9'  # a pod IP: a running pod there can hold requests (the drain waits for them)
CPU = {'model': {'builtin': 'tiny-sd'}, 'replicas': 2, 'resources': {'gpusPerPod': 1, 'gpuResourceName': ''}}
GPU = {'model': {'path': '/models/sd'}, 'replicas': 1, 'parallel': {'cfgParallelSize': 2},
       'resources': {'gpusPerPod': 2, 'gpuResourceName': 'nvidia.com/gpu'}}


def stage(spec: dict[str, Any] | None = None, status: dict[str, Any] | None = None, generation: int = 1, **meta: Any):
    return parse_stage({'metadata': {'name': 's', 'namespace': 'ns', 'uid': 'uid-1', 'generation': generation, **meta},
                        'spec': copy.deepcopy(spec or CPU), 'status': status or {}})


def pod(st, index: int, state: str = 'ready', pod_hash: str | None = None) -> dict[str, Any]:
    obj = build_pod(st, index, pod_hash)
    obj['metadata']['uid'] = f'pod-{index}'
    obj['status'] = {  # what a kubelet (or the scheduler) reports: the pod runner's builders
        'ready': kubelet.running('stage', True, IP, started=T0),
        'starting': kubelet.running('stage', False, IP, started=T0),
        'pending': {'phase': 'Pending'},
        'unschedulable': kubelet.unschedulable('0/3 nodes'),
        'failed': kubelet.failed('stage', 3, 'EngineDead: collective timed out', at=T0),
        'terminating': kubelet.running('stage', True, IP, started=T0),
    }[state]
    if state == 'terminating':
        obj['metadata']['deletionTimestamp'] = T0
    return obj


def world(st, pods=(), *, children: bool = True, nodes=None, now: str = T1) -> Observed:
    return Observed(pods=list(pods), service=build_service(st) if children else None,
                    configmap=build_configmap(st) if children else None,
                    pdb=build_pdb(st, st.spec.replicas) if children else None,
                    network_policy=build_network_policy(st) if children else None, nodes=nodes, now=now)


def node(name: str, gpus: int, unschedulable: bool = False) -> dict[str, Any]:
    return {'metadata': {'name': name}, 'spec': {'unschedulable': unschedulable},
            'status': {'allocatable': {'nvidia.com/gpu': str(gpus), 'cpu': '32'}}}


def settle(st, observed: Observed):
    """The stage as it looks after the plan's status was written (the next reconcile's input)."""
    plan = reconcile(st, observed)
    status = copy.deepcopy(dict(st.status))
    apply_merge(status, plan.status or {})
    return stage(spec=st.spec.wire() if st.spec else None, status=status, generation=st.generation), plan


def apply_merge(target: dict, patch: dict) -> None:
    """An RFC 7386 merge patch applied in place (as the API server applies the plan's patches)."""
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        elif isinstance(v, dict) and isinstance(target.get(k), dict):
            apply_merge(target[k], v)
        else:
            target[k] = copy.deepcopy(v)
