"""Steady load through a Service, from a thread: what clients see while the cluster changes.

    with Load(cluster, 'tiny') as load:
        ...                        # scale, roll, delete a pod
    load.answers, load.failures    # requests answered; every answer that was not 200 (or no answer), with why
"""
from __future__ import annotations

import threading
import time

import httpx


class Load:
    def __init__(self, cluster, service: str, steps: int = 2):
        self.cluster, self.service, self.steps = cluster, service, steps
        self.answers, self.failures = 0, []
        self.by_endpoint: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name='load', daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            url = self.cluster.service_url(self.service)
            if url is None:
                self.failures.append('no ready endpoint behind the Service')
                time.sleep(0.1)
                continue
            try:
                response = httpx.post(f'{url}/v1/images/generations', timeout=60,
                                      json={'prompt': 'load', 'size': '64x64', 'num_inference_steps': self.steps})
            except httpx.HTTPError as exc:
                self.failures.append(f'{url}: {exc!r}')
                continue
            self.answers += 1
            self.by_endpoint[url] = self.by_endpoint.get(url, 0) + 1
            if response.status_code != 200:
                self.failures.append(f'{url}: {response.status_code} {response.text[:200]}')

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(90)
