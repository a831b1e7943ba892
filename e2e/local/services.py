"""A Service without kube-proxy: the ready pods its selector picks, as URLs of its target port.

What Kubernetes' EndpointSlice controller computes (pods that match the selector, are Ready and not
terminating, at their podIP and the container port the Service's targetPort names), read from the API
each time, so a pod fenced out of the Service (its serving label flipped) or not ready is never picked.
"""
from __future__ import annotations

import itertools
from typing import Any

import httpx


def _target_port(pod: dict[str, Any], target: int | str) -> int | None:
    if isinstance(target, int):
        return target
    ports = (p for c in pod['spec']['containers'] for p in c.get('ports') or ())
    return next((p['containerPort'] for p in ports if p.get('name') == target), None)


def _ready(pod: dict[str, Any]) -> bool:
    status = pod.get('status') or {}
    ready = any(c.get('type') == 'Ready' and c.get('status') == 'True' for c in status.get('conditions') or ())
    return ready and bool(status.get('podIP')) and not pod['metadata'].get('deletionTimestamp')


class ServiceResolver:
    def __init__(self, api: httpx.Client):
        self.api = api
        self._turn = itertools.count()

    def endpoints(self, namespace: str, service: str, port: str = 'http') -> list[str]:
        """`http://podIP:port` of every ready pod behind the Service, sorted; [] if the Service is missing."""
        response = self.api.get(f'/api/v1/namespaces/{namespace}/services/{service}')
        if response.status_code == 404:
            return []
        response.raise_for_status()
        spec = response.json()['spec']
        target = next(p.get('targetPort', p['port']) for p in spec['ports'] if p.get('name') == port)
        selector = ','.join(f'{k}={v}' for k, v in sorted(spec['selector'].items()))
        pods = self.api.get(f'/api/v1/namespaces/{namespace}/pods', params={'labelSelector': selector})
        pods.raise_for_status()
        urls = {f'http://{pod["status"]["podIP"]}:{number}' for pod in pods.json()['items']
                if _ready(pod) and (number := _target_port(pod, target)) is not None}
        return sorted(urls)

    def url(self, namespace: str, service: str, port: str = 'http') -> str | None:
        """One endpoint, round robin (what a ClusterIP connection gets); None while none is ready."""
        urls = self.endpoints(namespace, service, port)
        return urls[next(self._turn) % len(urls)] if urls else None
