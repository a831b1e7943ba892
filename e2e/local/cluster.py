"""The embedded local cluster: the emulated Kubernetes API, the operator as a real process
(`python -m stage_operator --namespace NS --standalone`, its kubeconfig pointing at the emulator) and the
pod runner (every pod as local processes). It is a `scenario.Driver`: the hands of kubectl over HTTP.
The containers' logs (`kubectl logs`) are files under `<workdir>/logs`, kept after the cluster stops.

    with LocalCluster(workdir) as cluster:
        cluster.apply(scenario.sample())
        ...
    cluster.leftovers()   # processes or /dev/shm segments the stopped pods left behind ({} when clean)
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from e2e.local.container_logs import ContainerLogs
from e2e.local.driver import ApiDriver
from e2e.local.kube_emulator import KubeEmulator, running
from e2e.local.pod_process import group_members
from e2e.local.pod_runner import PodRunner
from e2e.local.services import ServiceResolver
from e2e.scenario import wait_for
from stage_operator.api.meta import DEFAULT_GPU_RESOURCE, PLURAL

ROOT = Path(__file__).resolve().parents[2]
SHM = Path('/dev/shm')
FAKE_GPUS = 8  # the node's nvidia.com/gpu capacity (the pods here run CPU ranks)
Obj = dict[str, Any]


class LocalCluster:
    def __init__(self, workdir: Path, namespace: str = 'default', resync_seconds: float = 2.0, port: int | None = None):
        self.workdir, self.namespace, self.resync_seconds, self.port = Path(workdir).resolve(), namespace, resync_seconds, port
        self.emulator: KubeEmulator | None = None
        self.operator: subprocess.Popen | None = None
        self.runner: PodRunner | None = None
        self.api: httpx.Client | None = None
        self.services: ServiceResolver | None = None
        self.hands: ApiDriver | None = None
        self.kubeconfig: Path | None = None  # for kubectl: written once the API runs
        self._stack = ExitStack()
        self._shm_before: set[str] = set()

    @property
    def logs_dir(self) -> Path:
        """Every container run's log: `<namespace>_<pod>_<uid>/<container>/<restartCount>.log` (container_logs.py)."""
        return self.workdir / 'logs'

    @property
    def operator_log(self) -> str:
        path = self.workdir / 'operator.log'
        return path.read_text(errors='replace') if path.exists() else ''

    def __enter__(self) -> LocalCluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._shm_before = set(os.listdir(SHM)) if SHM.is_dir() else set()
        try:
            self.emulator = self._stack.enter_context(running(port=self.port))
            if self.namespace != 'default':
                self.emulator.seed('namespaces', {'metadata': {'name': self.namespace}})
            self.emulator.seed('nodes', {'metadata': {'name': 'local'}, 'status': {  # fake GPUs, as on kind
                'capacity': {'cpu': str(os.cpu_count()), DEFAULT_GPU_RESOURCE: str(FAKE_GPUS)},
                'allocatable': {'cpu': str(os.cpu_count()), DEFAULT_GPU_RESOURCE: str(FAKE_GPUS)},
                'conditions': [{'type': 'Ready', 'status': 'True', 'reason': 'KubeletReady'}]}})
            self.api = self._stack.enter_context(httpx.Client(base_url=self.emulator.base_url, timeout=10))
            self.services = ServiceResolver(self.api)
            self.hands = ApiDriver(self.emulator.base_url, self.namespace, self.services)
            self._stack.callback(self.hands.close)
            self._start_operator()
            self.emulator.logs = logs = ContainerLogs(self.logs_dir)  # kept after the cluster stops
            self.runner = PodRunner(self.emulator.base_url, root=self.workdir, logs=logs).start()
            self._stack.callback(self.runner.close)
            wait_for(lambda: self.emulator.watching(PLURAL) and self.emulator.watching('pods') >= 2, 90,
                     'the operator and the pod runner to watch', lambda: self.operator_log[-3000:])
        except BaseException:
            self._stack.close()
            raise
        return self

    def _start_operator(self) -> None:
        kubeconfig = self.kubeconfig = self.emulator.write_kubeconfig(self.workdir / 'kubeconfig', self.namespace)
        env = {**os.environ, 'KUBECONFIG': str(kubeconfig), 'PYTHONPATH': str(ROOT)}
        with open(self.workdir / 'operator.log', 'wb') as log:
            self.operator = subprocess.Popen(
                [sys.executable, '-m', 'stage_operator', '--namespace', self.namespace, '--standalone',
                 '--resync-seconds', str(self.resync_seconds)],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        self._stack.callback(self._stop_operator)

    def _stop_operator(self) -> None:
        if self.operator.poll() is None:
            self.operator.send_signal(signal.SIGTERM)
            try:
                self.operator.wait(30)
            except subprocess.TimeoutExpired:
                self.operator.kill()
                self.operator.wait(10)
                raise AssertionError(f'the operator ignored SIGTERM for 30 s:\n{self.operator_log[-3000:]}') from None

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    # -- after exit ----------------------------------------------------------------------------------
    def leftovers(self) -> dict[str, Any]:
        """What the run left behind; {} when clean. Call after the `with` block."""
        out: dict[str, Any] = {}
        if self.runner is not None and self.runner.leftovers:
            out['processes that outlived their pod'] = dict(self.runner.leftovers)
        groups = self.runner.all_groups if self.runner is not None else []
        if alive := group_members(groups):
            out['live pod processes'] = alive
        pids = {str(p) for p in groups}
        shm = {name for name in (set(os.listdir(SHM)) if SHM.is_dir() else set()) - self._shm_before
               if pids & set(name.replace('_', '-').split('-'))}
        if shm:
            out['/dev/shm segments'] = sorted(shm)
        if self.operator is not None and self.operator.poll() is None:
            out['operator'] = self.operator.pid
        return out

    # -- scenario.Driver: the HTTP hands (driver.ApiDriver) ------------------------------------------
    def apply(self, manifest: Obj) -> Obj:
        return self.hands.apply(manifest)

    def stage(self, name: str) -> Obj | None:
        return self.hands.stage(name)

    def stages(self) -> list[Obj]:
        return self.hands.stages()

    def patch_spec(self, name: str, spec: Obj) -> Obj:
        return self.hands.patch_spec(name, spec)

    def scale(self, name: str, replicas: int) -> Obj:
        return self.hands.scale(name, replicas)

    def delete(self, name: str) -> None:
        self.hands.delete(name)

    def pods(self, stage: str) -> list[Obj]:
        return self.hands.pods(stage)

    def service_url(self, service: str) -> str | None:
        return self.hands.service_url(service)
