"""What a kubelet writes into `pod.status`, as plain builders: the pod runner reports through them, and tests
that play the kubelet (or the scheduler) write the same shapes.

    running(container, ready=True, ip='127.100.0.2')   # Running, scheduled, Ready or not, with a podIP
    failed(container, exit_code=3, message='WorkerDied: ...')
    unschedulable('0/1 nodes are available: 1 Insufficient nvidia.com/gpu.')
"""
from __future__ import annotations

import datetime
from typing import Any

Obj = dict[str, Any]


def now(millis: bool = False) -> str:
    at = datetime.datetime.now(datetime.UTC)
    return at.strftime('%Y-%m-%dT%H:%M:%S') + (f'.{at.microsecond // 1000:03d}Z' if millis else 'Z')


def condition(kind: str, status: bool, reason: str | None = None, message: str | None = None,
              at: str | None = None) -> Obj:
    out = {'type': kind, 'status': 'True' if status else 'False', 'lastTransitionTime': at or now()}
    return {**out, **({'reason': reason} if reason else {}), **({'message': message} if message else {})}


def _extra(restart_count: int, container_id: str | None, last: Obj | None) -> Obj:
    return {'restartCount': restart_count, **({'containerID': container_id} if container_id else {}),
            **({'lastState': last} if last else {})}


def waiting_container(name: str, reason: str, message: str = '', image: str = '', restart_count: int = 0,
                      last: Obj | None = None) -> Obj:
    """Not running: ContainerCreating, PodInitializing, CrashLoopBackOff, CreateContainerConfigError."""
    waiting = {'reason': reason, **({'message': message} if message else {})}
    return {'name': name, 'ready': False, 'started': False, 'image': image, 'state': {'waiting': waiting},
            **_extra(restart_count, None, last)}


def running_container(name: str, ready: bool, started: str, image: str = '', restart_count: int = 0,
                      container_id: str | None = None, last: Obj | None = None) -> Obj:
    """`last`: the lastState of a restarted container ({'terminated': terminated_state(...)})."""
    return {'name': name, 'ready': ready, 'started': True, 'image': image,
            'state': {'running': {'startedAt': started}}, **_extra(restart_count, container_id, last)}


def terminated_state(code: int, message: str, at: str | None = None, started: str | None = None,
                     container_id: str | None = None) -> Obj:
    """`started`: when it began (an init container's run time is `finishedAt - startedAt`, in ms)."""
    exit_code = code if code >= 0 else 128 - code  # killed by signal N: 128 + N, as a container runtime says
    term = {'exitCode': exit_code, 'reason': 'Completed' if code == 0 else 'Error', 'message': message,
            'finishedAt': at or now(millis=started is not None)}
    return {**term, **({'startedAt': started} if started else {}),
            **({'containerID': container_id} if container_id else {})}


def terminated_container(name: str, code: int, message: str, image: str = '', at: str | None = None,
                         started: str | None = None, restart_count: int = 0, container_id: str | None = None,
                         last: Obj | None = None) -> Obj:
    return {'name': name, 'ready': False, 'image': image,
            'state': {'terminated': terminated_state(code, message, at, started, container_id)},
            **_extra(restart_count, container_id, last)}


def addresses(ip: str | None) -> Obj:
    return {'podIP': ip, 'podIPs': [{'ip': ip}], 'hostIP': '127.0.0.1'} if ip else {}


def scheduled() -> Obj:
    return condition('PodScheduled', True)


def running(container: str = 'stage', ready: bool = True, ip: str | None = None, started: str | None = None) -> Obj:
    """Scheduled, initialized, the container running, its readiness probe passing (or not)."""
    started = started or now()
    return {'phase': 'Running', **addresses(ip), 'startTime': started,
            'conditions': [scheduled(), condition('Initialized', True), condition('Ready', ready)],
            'containerStatuses': [running_container(container, ready, started)]}


def failed(container: str = 'stage', exit_code: int = 1, message: str = '', at: str | None = None) -> Obj:
    """The container exited non-zero: phase Failed, its exit code and termination message."""
    return {'phase': 'Failed' if exit_code else 'Succeeded',
            'conditions': [scheduled(), condition('Initialized', True), condition('Ready', False)],
            'containerStatuses': [terminated_container(container, exit_code, message, at=at)]}


def unschedulable(message: str) -> Obj:
    """The scheduler found no node: Pending, PodScheduled=False (Unschedulable) with its message."""
    return {'phase': 'Pending', 'conditions': [condition('PodScheduled', False, 'Unschedulable', message)]}
