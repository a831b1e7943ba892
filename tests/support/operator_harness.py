"""Run the real operator (kopf, in a thread of this process) against the emulated API; the test plays the
kubelet and the scheduler with the pod runner's status builders (e2e/local/kubelet.py). Pods are reached as
in a cluster, at `http://<podIP>:8000`: a live pod is a real process listening on a loopback pod address.

    with operator(emulator, '--resync-seconds=0.5') as op:   # the flags of `python -m stage_operator`
        cluster.apply(manifest('tiny')); cluster.kubelet_ready('tiny-0', ip=...)
    op.output    # the operator's log lines
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from support.kube_emulator import KubeEmulator
from support.waiting import wait_until

from e2e.local import kubelet
from e2e.local.driver import MERGE, ApiDriver  # noqa: F401 (MERGE: re-exported for the tests)
from stage_operator.api.meta import API_VERSION, DEFAULT_GPU_RESOURCE, KIND, LABEL_STAGE, PLURAL

STAGES_PATH = f'/apis/{API_VERSION}/namespaces/default/{PLURAL}'
DEFAULT_FLAGS = ('--namespace=default', '--standalone', '--resync-seconds=0.5')
TINY = {'model': {'builtin': 'tiny-sd'}, 'replicas': 2, 'parallel': {'cfgParallelSize': 2},
        'resources': {'gpusPerPod': 2, 'gpuResourceName': ''}, 'engine': {'executionMode': 'step', 'maxNumSeqs': 4}}
FINISHED_AT = '2026-01-01T00:01:00Z'  # what kubelet_failed reports as the container's finishedAt


def manifest(name: str, **spec: Any) -> dict[str, Any]:
    return {'apiVersion': API_VERSION, 'kind': KIND, 'metadata': {'name': name},
            'spec': {**copy.deepcopy(TINY), **spec}}


def wait_for(condition: Callable[[], Any], timeout: float = 20, what: str = 'condition') -> Any:
    """The suite's one wait (support.waiting), polling the emulator every 50 ms."""
    return wait_until(condition, timeout, what, poll=0.05)


def reconciles() -> float:
    """Reconciles the in-process operator has run so far (its own counter, every outcome)."""
    from prometheus_client import REGISTRY
    return sum(REGISTRY.get_sample_value('diffstage_operator_reconciles_total', {'result': r}) or 0.0
               for r in ('changed', 'unchanged'))


def settle(past: float = 0.0, count: int = 2, timeout: float = 30) -> None:
    """Evidence that nothing more happens: ``count`` reconciles run after ``past`` more seconds (e.g. past a
    backoff that would have restarted a pod), each of which saw the same world and decided."""
    due = time.monotonic() + past
    wait_for(lambda: time.monotonic() >= due, timeout, what=f'{past} s to pass')
    start = reconciles()
    wait_for(lambda: reconciles() >= start + count, timeout, what=f'{count} reconciles after {past} s')


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter('%(levelname)s %(name)s: %(message)s'))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


class OperatorThread:
    """`python -m stage_operator FLAGS` as kopf.operator() in a thread with its own loop; its settings reach
    the handlers through memo.config, exactly as main() passes them."""

    def __init__(self, flags: tuple[str, ...]):
        from stage_operator.__main__ import build_parser, kopf_options, settings
        args = build_parser().parse_args(list(flags))
        options = kopf_options(args)
        assert not isinstance(options, str), options
        self.options, self.settings = options, settings(args)
        self.exception: BaseException | None = None
        self._capture = _Capture()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name='operator', daemon=True)

    @property
    def output(self) -> str:
        return '\n'.join(self._capture.lines)

    def _run(self) -> None:
        import kopf
        registry = kopf.OperatorRegistry()  # kopf registers handlers into the default registry on import:
        kopf.on.login(registry=registry)(kopf.login_via_client)  # a fresh one, and a fresh import, per run
        saved = kopf.get_default_registry()
        kopf.set_default_registry(registry)
        try:
            sys.modules.pop('stage_operator.handlers', None)
            import stage_operator.handlers  # noqa: F401
        finally:
            kopf.set_default_registry(saved)
            sys.modules.pop('stage_operator.handlers', None)
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(kopf.operator(registry=registry, stop_flag=self._stop,
                                                  memo=kopf.Memo(config=self.settings), **self.options))
        except BaseException as exc:  # noqa: BLE001 (reported by stop())
            self.exception = exc
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def start(self) -> OperatorThread:
        root = logging.getLogger()
        self._level = root.level
        root.setLevel(min(root.level, logging.INFO))  # what `python -m stage_operator` logs
        root.addHandler(self._capture)
        self._thread.start()
        return self

    def stop(self, timeout: float = 60) -> None:
        self._stop.set()
        self._thread.join(timeout)
        logging.getLogger().removeHandler(self._capture)
        logging.getLogger().setLevel(self._level)
        assert not self._thread.is_alive(), f'the operator did not stop within {timeout} s:\n{self.output[-3000:]}'


@contextlib.contextmanager
def operator(emulator: KubeEmulator, *flags: str) -> Iterator[OperatorThread]:
    """The operator, by default on the default namespace without peering, resyncing every 0.5 s; fails the
    test if it crashed or logged a traceback."""
    flags = flags or DEFAULT_FLAGS
    if not any(f.startswith('--resync-seconds') for f in flags):
        flags = (*flags, '--resync-seconds=0.5')
    runner = OperatorThread(tuple(flags)).start()
    try:
        wait_for(lambda: emulator.watching(PLURAL) and emulator.watching('pods'), what='the watches')
        yield runner
    finally:
        runner.stop()
    assert runner.exception is None, f'{runner.exception!r}\n{runner.output[-3000:]}'
    assert 'Traceback' not in runner.output, runner.output


class Cluster(ApiDriver):
    """The test's hands: kubectl (driver.ApiDriver over HTTP), the kubelet and the scheduler. Reads come
    from the emulator's memory (the operator's reads are the ones being tested)."""

    def __init__(self, emulator: KubeEmulator):
        super().__init__(emulator.base_url)
        self.emulator = emulator

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        response = self.http.post(self.stages_path(), json=manifest)
        assert response.status_code == 201, response.text
        return response.json()

    def stage(self, name: str) -> dict[str, Any] | None:
        return self.emulator.get('dstage', name)

    def status(self, name: str) -> dict[str, Any]:
        return (self.stage(name) or {}).get('status') or {}

    def condition(self, name: str, kind: str) -> dict[str, Any]:
        return next((c for c in self.status(name).get('conditions', ()) if c['type'] == kind), {})

    def pods(self, stage: str) -> dict[str, dict[str, Any]]:  # type: ignore[override]
        """name → pod (the Driver's list, keyed for the tests)."""
        return {p['metadata']['name']: p for p in self.emulator.objects('pods', 'default')
                if p['metadata'].get('labels', {}).get(LABEL_STAGE) == stage}

    def kubelet_ready(self, pod: str, ready: bool = True, ip: str | None = None) -> None:
        """Scheduled, started, probes passing (or not); at `ip` when given (a live pod listens there)."""
        self.pod_status(pod, kubelet.running('stage', ready, ip, started='2026-01-01T00:00:00Z'))

    def kubelet_failed(self, pod: str, exit_code: int, message: str) -> None:
        self.pod_status(pod, kubelet.failed('stage', exit_code, message, at=FINISHED_AT))

    def scheduler_unschedulable(self, pod: str, message: str) -> None:
        self.pod_status(pod, kubelet.unschedulable(message))

    def all_ready(self, stage: str) -> None:
        for name in self.pods(stage):
            self.kubelet_ready(name)

    def add_gpu_node(self, name: str, gpus: int, resource: str = DEFAULT_GPU_RESOURCE) -> None:
        self.emulator.seed('nodes', {'metadata': {'name': name}, 'status': {'allocatable': {resource: str(gpus)}}})
