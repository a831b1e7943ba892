"""The scenario's hands on a real cluster: kubectl for what a user types (apply, scale, delete, port-forward),
the official Python client for reads and spec patches."""
from __future__ import annotations

import json
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import kubernetes

from stage_operator.api.meta import GROUP, LABEL_STAGE, PLURAL, VERSION

Obj = dict[str, Any]
_FORWARDING = re.compile(r'Forwarding from 127\.0\.0\.1:(\d+)')


def kubectl(*args: str, input: str | None = None, timeout: float = 300) -> str:
    out = subprocess.run(['kubectl', *args], input=input, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f'kubectl {" ".join(args)} failed ({out.returncode}): {out.stderr.strip()}')
    return out.stdout


class KindDriver:
    def __init__(self, namespace: str = 'default'):
        self.namespace = namespace
        self.client = kubernetes.config.new_client_from_config()  # $KUBECONFIG: the kind cluster's
        self.custom = kubernetes.client.CustomObjectsApi(self.client)
        self.core = kubernetes.client.CoreV1Api(self.client)
        self._forwards: dict[str, tuple[subprocess.Popen, str]] = {}

    def apply(self, manifest: Obj) -> None:
        kubectl('apply', '-n', self.namespace, '-f', '-', input=json.dumps(manifest))

    def stage(self, name: str) -> Obj | None:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def stages(self) -> list[Obj]:
        return self.custom.list_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL)['items']

    def patch_spec(self, name: str, spec: Obj) -> None:
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name, {'spec': spec})

    def scale(self, name: str, replicas: int) -> None:
        kubectl('scale', '-n', self.namespace, f'{PLURAL}.{GROUP}/{name}', f'--replicas={replicas}')

    def delete(self, name: str) -> None:
        kubectl('delete', '-n', self.namespace, f'{PLURAL}.{GROUP}/{name}', '--wait=false')

    def pods(self, stage: str) -> list[Obj]:
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=f'{LABEL_STAGE}={stage}')
        return self.client.sanitize_for_serialization(pods)['items']

    def service_url(self, service: str) -> str | None:
        """`kubectl port-forward service/NAME :http` (restarted when the pod behind it went away)."""
        process, url = self._forwards.get(service, (None, ''))
        if process is not None and process.poll() is None:
            return url
        log = tempfile.NamedTemporaryFile(prefix=f'port-forward-{service}-', suffix='.log', delete=False)
        with log:
            process = subprocess.Popen(['kubectl', 'port-forward', '-n', self.namespace, f'service/{service}',
                                        ':http'], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and process.poll() is None:
            if match := _FORWARDING.search(Path(log.name).read_text()):
                url = f'http://127.0.0.1:{match[1]}'
                self._forwards[service] = (process, url)
                return url
            time.sleep(0.2)
        process.kill()
        process.wait(10)
        return None

    def close(self) -> None:
        for process, _ in self._forwards.values():
            process.terminate()
            process.wait(10)
        self._forwards.clear()
        self.client.close()
