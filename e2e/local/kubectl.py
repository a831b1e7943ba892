"""The real `kubectl` against the embedded cluster: what a user types, as a test's hands.

    kubectl = Kubectl(kubeconfig)          # KUBECONFIG for every call; nothing from ~/.kube
    kubectl('get', 'dstage')               # CompletedProcess; check=True raises with stdout and stderr
    KubectlDriver(cluster, kubectl)        # a scenario.Driver whose writes are kubectl commands

`KUBECTL_MISSING` is the skip reason where the binary is absent (it is preinstalled on these machines and
in CI, not on a user's fresh machine).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from stage_operator.api.meta import PLURAL

KUBECTL = shutil.which('kubectl')
KUBECTL_MISSING = 'kubectl is not installed (it is on the dev machines and in CI); the kubectl suite needs it'
Obj = dict[str, Any]


class KubectlError(AssertionError):
    pass


class Kubectl:
    def __init__(self, kubeconfig: str | Path, binary: str | None = KUBECTL, timeout: float = 60):
        if binary is None:
            raise RuntimeError(KUBECTL_MISSING)
        self.binary, self.timeout = binary, timeout
        self.env = {**os.environ, 'KUBECONFIG': str(kubeconfig),
                    'KUBECACHEDIR': str(Path(kubeconfig).parent / 'kube-cache')}  # not ~/.kube/cache

    def __call__(self, *args: str, input: str | None = None, check: bool = True,
                 timeout: float | None = None) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([self.binary, *args], input=input, capture_output=True, text=True, env=self.env,
                                timeout=timeout or self.timeout, check=False)
        if check and result.returncode != 0:
            raise KubectlError(f'kubectl {" ".join(args)} exited {result.returncode}\n'
                               f'stdout: {result.stdout}\nstderr: {result.stderr}')
        return result

    def json(self, *args: str) -> Obj:
        return json.loads(self(*args, '-o', 'json').stdout)


class KubectlDriver:
    """scenario.Driver: applies, scales, patches and deletes with kubectl; reads through the cluster's API
    client (a kubectl process per poll would take a core on this machine)."""

    def __init__(self, cluster: Any, kubectl: Kubectl):
        self.cluster, self.kubectl, self.namespace = cluster, kubectl, cluster.namespace

    def apply(self, manifest: Obj) -> None:
        self.kubectl('apply', '-n', self.namespace, '-f', '-', input=yaml.safe_dump(manifest))

    def stage(self, name: str) -> Obj | None:
        return self.cluster.stage(name)

    def patch_spec(self, name: str, spec: Obj) -> None:
        self.kubectl('patch', '-n', self.namespace, PLURAL, name, '--type', 'merge', '-p', json.dumps({'spec': spec}))

    def scale(self, name: str, replicas: int) -> None:
        self.kubectl('scale', '-n', self.namespace, PLURAL, name, f'--replicas={replicas}')

    def delete(self, name: str) -> None:
        self.kubectl('delete', '-n', self.namespace, PLURAL, name, '--wait=false')

    def pods(self, stage: str) -> list[Obj]:
        return self.cluster.pods(stage)

    def service_url(self, service: str) -> str | None:
        return self.cluster.service_url(service)
