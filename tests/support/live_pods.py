"""Pods of the emulated cluster played by local processes: a real `stage-runtime serve` per pod (`live_stages`),
or a small stand-in HTTP server (`StandIn`) only where a stage must misbehave in a way a real one cannot be made
to (hang with /health 503). What the stand-in answers is written once (`stand_in_answers`) and checked against
the real stage's own /openapi.json (tests/support/test_live_pods.py), so the two cannot drift.

Each listens on its own loopback pod address at the stage's port (8000), drawn from the pod runner's
sequence (`pod_address()`), so the operator reaches it at `http://<podIP>:8000` as in a cluster. The test
plays kubelet: it reports the pod Running/Ready at that podIP, and Failed with the process's exit code and
termination-log contents once the process exits."""
from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web

from stage_process import StageProcess
from support.operator_harness import Cluster, wait_for

from e2e.local.pod_runner import next_pod_ip
from stage_operator.api.meta import HTTP_PORT


def pod_address() -> tuple[str, list[str]]:
    """A free pod IP, and the `stage-runtime serve` flags that listen there as a pod would."""
    ip = next_pod_ip()
    return ip, ['--host', ip, '--http-port', str(HTTP_PORT)]


# The cheapest live stage: one CPU rank in the server process, step scheduling, four sequences.
ONE_RANK_STAGE = ('--device', 'cpu', '--executor', 'uni', '--execution-mode', 'step', '--max-num-seqs', '4')


@contextlib.contextmanager
def live_stages(model: str, logs: Path, count: int,
                args: tuple[str, ...] = ONE_RANK_STAGE) -> Iterator[list[StageProcess]]:
    """`count` real stages, each at its own pod address: all started, then each waited for (they load side by
    side). On the way out, whatever happened in the block: SIGTERM to all, then each must exit 0 and leave no
    process or /dev/shm segment behind (killed in any case)."""
    stages = [StageProcess(['--model', model, *args, *pod_address()[1]], logs / f'stage-{i}.log') for i in range(count)]
    try:
        for s in stages:
            s.start(wait_ready=False)
        for s in stages:
            s.wait_ready()
        yield stages
    finally:
        problems = []
        started = [s for s in stages if s.proc is not None]
        for s in started:
            if s.proc.poll() is None:
                s.signal(signal.SIGTERM)
        for s in started:
            try:
                code = s.wait()
                assert code == 0, f'{s.log_path.name} exited with {code}:\n{s.log[-2000:]}'
                s.assert_no_leaks()
            except AssertionError as exc:
                problems.append(str(exc))
        for s in stages:
            s.kill()
        assert not problems, '\n'.join(problems)


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


def stand_in_answers(dead: str | None = None) -> dict[str, tuple[int, dict[str, Any]]]:
    """Every route a StandIn serves (GET) → (status, JSON body): a one-rank stage, idle, alive or dead for
    `dead`. The one place its bodies are written; checked against the real stage's /openapi.json."""
    health = ((503, {'error': {'type': 'engine_dead', 'message': f'Engine is dead: {dead}'}}) if dead
              else (200, {'status': 'ok', 'state': 'ready'}))
    stats = {'state': 'dead' if dead else 'ready', 'waiting': 0, 'running': 0, 'capacity': 4, 'finished_total': 0,
             'aborted_total': 0, 'failed_total': 0, 'world_size': 1,
             'topology': 'world_size=1 (tp=1 sp=1[ulysses=1 ring=1] pp=1 cfg=1 dp=1)',
             'workers': [{'rank': 0, 'pid': None, 'alive': not dead}],
             'cost': {'outstanding': 0, 'completed_total': 0, 'rate': 0.0},
             'startup': {'phase': None, 'detail': '', 'elapsed_s': 4.0, 'phases': {'loadingWeights': 1.0},
                         'model_bytes': None}}
    return {'/health': health, '/v1/stats': (200, stats)}


class StandIn:
    """A stage that answers like a hung one: /health 503 with a reason once `dead` is set (200 until then);
    `stand_in_answers` is all it says. `app`: its routes."""

    def __init__(self, dead: str | None = None):
        self.dead = dead
        self.url = ''
        self.app = web.Application()
        for path in stand_in_answers():
            self.app.router.add_get(path, self._answer)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    async def _answer(self, request: web.Request) -> web.Response:
        status, body = stand_in_answers(self.dead)[request.path]
        return web.json_response(body, status=status)

    async def _serve(self) -> str:
        self._runner = web.AppRunner(self.app)
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
