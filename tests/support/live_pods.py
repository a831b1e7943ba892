"""Pods of the emulated cluster played by local processes: a real `stage-runtime serve` per pod, or a small
stand-in HTTP server where a stage must misbehave in a way a real one does not (hang with /health 503).

Each listens on its own loopback pod address at the stage's port (8000), drawn from the pod runner's
sequence (`pod_address()`), so the operator reaches it at `http://<podIP>:8000` as in a cluster. The test
plays kubelet: it reports the pod Running/Ready at that podIP, and Failed with the process's exit code and
termination-log contents once the process exits."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from aiohttp import web

from support.operator_harness import Cluster, wait_for

from e2e.local.pod_runner import next_pod_ip
from stage_operator.api.meta import HTTP_PORT


def pod_address() -> tuple[str, list[str]]:
    """A free pod IP, and the `stage-runtime serve` flags that listen there as a pod would."""
    ip = next_pod_ip()
    return ip, ['--host', ip, '--http-port', str(HTTP_PORT)]


def map_pod(cluster: Cluster, pod: str, url: str, ready: bool = True) -> None:
    """The kubelet's report for a pod whose container listens at `url` (http://<podIP>:8000): Running
    (and Ready) at that podIP."""
    host, port = httpx.URL(url).host, httpx.URL(url).port
    assert port == HTTP_PORT, f'the operator reaches pods at port {HTTP_PORT}, not {url}'
    cluster.kubelet_ready(pod, ready, ip=host)


def pod_uid(cluster: Cluster, stage: str, pod: str) -> str | None:
    obj = cluster.pods(stage).get(pod)
    return obj['metadata']['uid'] if obj else None


def replica(cluster: Cluster, stage: str, index: int = 0) -> dict[str, Any]:
    return next((r for r in cluster.status(stage).get('replicaStatuses', ()) if r['index'] == index), {})


def events(emulator, stage: str, reason: str | None = None) -> list[dict[str, Any]]:
    return [e for e in emulator.objects('events') if e['involvedObject']['name'] == stage
            and (reason is None or e['reason'] == reason)]


class Generation(threading.Thread):
    """One image request in a thread: `.status` and `.body` once it answered; `.done_at` (monotonic)."""

    def __init__(self, url: str, request_id: str, steps: int, headers: dict[str, str] | None = None):
        super().__init__(daemon=True)
        self.url, self.request_id, self.steps, self.headers = url, request_id, steps, headers or {}
        self.status: int | None = None
        self.body: dict[str, Any] = {}
        self.done_at = 0.0
        self.start()

    def run(self) -> None:
        body = {'prompt': 'a cat', 'size': '64x64', 'num_inference_steps': self.steps, 'seed': 1,
                'request_id': self.request_id, 'response_format': 'b64_json'}
        response = httpx.post(f'{self.url}/v1/images/generations', json=body, timeout=300, headers=self.headers)
        self.status, self.body, self.done_at = response.status_code, response.json(), time.monotonic()


def in_flight(url: str, headers: dict[str, str] | None = None) -> int:
    stats = httpx.get(f'{url}/v1/stats', timeout=5, headers=headers).json()
    return stats['waiting'] + stats['running']


def wait_in_flight(url: str, count: int, calls: list[Generation], timeout: float = 30,
                   headers: dict[str, str] | None = None) -> None:
    def check() -> bool:
        ended = [(c.request_id, c.status, c.body) for c in calls if c.status is not None]
        assert not ended, f'requests ended before the test could use them: {ended}'
        return in_flight(url, headers) >= count
    wait_for(check, timeout, what=f'{count} requests in flight at {url}')


class StandIn:
    """A stage that answers like a hung one: /health 503 with a reason (or 200 until told otherwise)."""

    def __init__(self, dead: str | None = None):
        self.dead = dead
        self.url = ''
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def _json(self, body: dict[str, Any], status: int = 200) -> web.Response:
        return web.Response(text=json.dumps(body), status=status, content_type='application/json')

    async def _health(self, _: web.Request) -> web.Response:
        if self.dead:
            return self._json({'error': {'type': 'engine_dead', 'message': f'Engine is dead: {self.dead}'}}, 503)
        return self._json({'status': 'ok', 'state': 'ready'})

    async def _stats(self, _: web.Request) -> web.Response:
        return self._json({'state': 'dead' if self.dead else 'ready', 'waiting': 0, 'running': 0, 'capacity': 1,
                           'workers': []})

    async def _serve(self) -> str:
        app = web.Application()
        app.router.add_get('/health', self._health)
        app.router.add_get('/v1/stats', self._stats)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        ip = next_pod_ip()
        await web.TCPSite(self._runner, ip, HTTP_PORT).start()
        return f'http://{ip}:{HTTP_PORT}'

    def __enter__(self) -> StandIn:
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)
        return self

    def __exit__(self, *_: Any) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def watch_until(condition: Callable[[], Any], timeout: float, what: str, poll: float = 0.02) -> float:
    """Wait for `condition` polling finely; the monotonic time it first held."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f'timed out waiting for {what}'
        time.sleep(poll)
    return time.monotonic()
