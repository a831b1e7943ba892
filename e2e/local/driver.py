"""The hands of kubectl over HTTP: one `scenario.Driver` for the local cluster, the operator integration
tests and `make cluster` (KubectlDriver in kubectl.py is the same with the real binary).

    hands = ApiDriver(base_url, namespace='default')
    hands.apply(manifest); hands.scale('tiny', 3); hands.stage('tiny'); hands.pods('tiny')
"""
from __future__ import annotations

from typing import Any

import httpx

from stage_operator.api.meta import API_VERSION, LABEL_STAGE, PLURAL

MERGE = {'Content-Type': 'application/merge-patch+json'}
Obj = dict[str, Any]


class ApiDriver:
    def __init__(self, base_url: str, namespace: str = 'default', resolver: Any = None):
        self.namespace = namespace
        self.http = httpx.Client(base_url=base_url, timeout=10)
        self.services = resolver  # a ServiceResolver, where something routes to pods (the local cluster)

    def close(self) -> None:
        self.http.close()

    def stages_path(self, name: str = '') -> str:
        return f'/apis/{API_VERSION}/namespaces/{self.namespace}/{PLURAL}' + (f'/{name}' if name else '')

    @staticmethod
    def ok(response: httpx.Response) -> Obj:
        assert response.is_success, f'{response.request.method} {response.request.url}: {response.text}'
        return response.json()

    # -- scenario.Driver -----------------------------------------------------------------------------
    def apply(self, manifest: Obj) -> Obj:
        """Create the stage, or merge its spec into the existing one; the stored object."""
        name = manifest['metadata']['name']
        if self.http.get(self.stages_path(name)).status_code == 404:
            return self.ok(self.http.post(self.stages_path(), json=manifest))
        return self.patch_spec(name, manifest['spec'])

    def stage(self, name: str) -> Obj | None:
        response = self.http.get(self.stages_path(name))
        return None if response.status_code == 404 else self.ok(response)

    def stages(self) -> list[Obj]:
        return self.ok(self.http.get(self.stages_path()))['items']

    def patch_spec(self, name: str, spec: Obj) -> Obj:
        return self.ok(self.http.patch(self.stages_path(name), headers=MERGE, json={'spec': spec}))

    def scale(self, name: str, replicas: int) -> Obj:
        return self.ok(self.http.patch(self.stages_path(name) + '/scale', headers=MERGE,
                                       json={'spec': {'replicas': replicas}}))

    def delete(self, name: str) -> None:
        self.ok(self.http.delete(self.stages_path(name)))

    def pods(self, stage: str) -> list[Obj]:
        response = self.http.get(f'/api/v1/namespaces/{self.namespace}/pods',
                                 params={'labelSelector': f'{LABEL_STAGE}={stage}'})
        return self.ok(response)['items']

    def service_url(self, service: str) -> str | None:
        return None if self.services is None else self.services.url(self.namespace, service)

    # -- the kubelet's and the scheduler's hand (tests that play them) --------------------------------
    def pod_status(self, pod: str, status: Obj) -> None:
        """Replace what the kubelet reported for a pod (conditions and container statuses are replaced whole)."""
        path = f'/api/v1/namespaces/{self.namespace}/pods/{pod}/status'
        self.ok(self.http.patch(path, headers=MERGE, json={'status': {'conditions': None, 'containerStatuses': None}}))
        self.ok(self.http.patch(path, headers=MERGE, json={'status': status}))
