"""A local kubelet for the emulated API: every pod it sees runs as local processes (pod_thread.py: one pod's life;
pod_process.py: how a pod maps onto this machine).

`PodRunner(base_url).start()` watches pods in every namespace. For a new pod it mounts the volumes (a
missing ConfigMap or Secret: the pod waits, a FailedMount Event says why), runs the init containers in
order, then the container; it reports what a kubelet reports into `status` — podIP, Pending with
initContainerStatuses, Running, the Ready condition from the readiness probe's HTTP GET (polled), restarts
as `restartPolicy` says (restartCount, lastState, CrashLoopBackOff), and on the end phase Failed (or
Succeeded) with the exit code and the termination message read from the container's termination log. Each
container run's output goes to its log file under `logs` (container_logs.py), which the API's `pods/log`
serves. A deleted pod's process gets SIGTERM after its preStop sleep (the only preStop action emulated),
SIGKILL at the end of the pod's grace period; processes that outlive their container are killed and recorded
in `leftovers` (a clean stage leaves none).
No scheduler: pods run where they are (`nodeName: local`), except that a pod with `schedulingGates` waits
(Pending, PodScheduled=False SchedulingGated, as the scheduler reports it) until its gates are removed.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from e2e.local import kubelet
from e2e.local.container_logs import ContainerLogs
from e2e.local.kubelet import now
from e2e.local.pod_process import LocalSources
from e2e.local.pod_thread import PodThread

log = logging.getLogger(__name__)
MERGE = {'Content-Type': 'application/merge-patch+json'}
Obj = dict[str, Any]


def loopback_addresses(ports: tuple[int, ...] = (8000, 5570)) -> Any:
    """127.<b>.x.y, with <b> from this process's pid, skipping any address where one of the pods' ports is taken
    (another runner on this machine, or a server listening on 0.0.0.0 there)."""
    base = 100 + os.getpid() % 150
    for i in itertools.count():
        address = f'127.{base}.{i // 250}.{i % 250 + 2}'
        if all(_bindable(address, port) for port in ports):
            yield address


_SHARED: Any = None
_SHARED_LOCK = threading.Lock()


def next_pod_ip() -> str:
    """The next free pod address for this process: the pod runner and tests that play the kubelet draw from
    one sequence, so two pods never get the same podIP."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = loopback_addresses()
        return next(_SHARED)


def _bindable(address: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((address, port))
        except OSError:
            return False
    return True


class PodRunner:
    def __init__(self, base_url: str, root: Path | None = None, logs: ContainerLogs | None = None):
        """`root`: where the pods' sandboxes go (a folder of its own, removed at close); `logs`: the node's log
        folder (default: inside that folder; the local cluster keeps it in its workdir, after the close)."""
        self.base_url = base_url
        # absolute: each pod runs in a sandbox of its own as working directory, so a relative root (make cluster's
        # default --workdir .cluster) would make every volume path miss
        self.root = Path(tempfile.mkdtemp(prefix='pod-runner-', dir=root)).resolve()
        self.api = httpx.Client(base_url=base_url, timeout=10)
        self.pods: dict[tuple[str, str], PodThread] = {}
        self._every: list[PodThread] = []  # every pod ever run, also those replaced by a new pod of the same name
        self.leftovers: dict[str, list[int]] = {}  # pod → processes that outlived its container
        self.gated: dict[tuple[str, str], str] = {}  # pods held by scheduling gates (not started): key → uid
        self.errors: list[str] = []  # the runner's own failures (a pod it could not run is reported in its status)
        # claims, images and the node's disk as local folders (tests bind claims and "pull" images here)
        self.sources = LocalSources(node_root=self.root / 'node-local')
        self.logs = logs or ContainerLogs(self.root / 'logs')
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._watcher = threading.Thread(target=self._watch_forever, name='pod-runner', daemon=True)

    def start(self) -> PodRunner:
        self._watcher.start()
        return self

    def running(self) -> list[str]:
        with self._lock:
            return sorted(f'{ns}/{name}' for (ns, name), t in self.pods.items() if t.is_alive())

    @property
    def all_groups(self) -> list[int]:
        """The process group of every container started so far (for leak checks)."""
        with self._lock:
            return [g for t in self._every if t.local is not None for g in t.local.groups]

    def close(self, timeout: float = 60) -> None:
        """Stop every pod as if deleted, then the watch; idempotent."""
        self._closing.set()
        with self._lock:
            threads = list(self._every)
        for thread in threads:
            thread.delete()
        for thread in threads:
            thread.join(timeout)
        self._watcher.join(timeout)
        self.api.close()
        shutil.rmtree(self.root)

    # -- the watch -----------------------------------------------------------------------------------
    def _watch_forever(self) -> None:
        while not self._closing.is_set():
            try:
                self._list_and_watch()
            except httpx.HTTPError as exc:  # the API went away or a watch broke: list again (level-based)
                if self._closing.is_set():
                    return
                log.warning('pod watch failed, listing again: %r', exc)
                time.sleep(0.5)
            except Exception as exc:  # a runner bug: recorded for the test, then raised
                self.errors.append(f'watch: {exc!r}')
                raise

    def _list_and_watch(self) -> None:
        listing = self.api.get('/api/v1/pods')
        listing.raise_for_status()
        body = listing.json()
        present = {(p['metadata']['namespace'], p['metadata']['name']) for p in body['items']}
        for pod in body['items']:
            self._seen(pod)
        with self._lock:
            gone = [t for key, t in self.pods.items() if key not in present]
        for thread in gone:
            thread.delete()
        params = {'watch': 'true', 'resourceVersion': body['metadata']['resourceVersion'], 'timeoutSeconds': '5'}
        with httpx.stream('GET', f'{self.base_url}/api/v1/pods', params=params, timeout=httpx.Timeout(10)) as stream:
            stream.raise_for_status()
            for line in stream.iter_lines():
                if self._closing.is_set():
                    return
                if line:
                    event = json.loads(line)
                    if event['type'] == 'DELETED':
                        self._deleted(event['object'])
                    elif event['type'] in ('ADDED', 'MODIFIED'):
                        self._seen(event['object'])

    def _seen(self, pod: Obj) -> None:
        key = (pod['metadata']['namespace'], pod['metadata']['name'])
        with self._lock:
            known = self.pods.get(key)
            if known is not None and known.uid == pod['metadata']['uid']:
                if pod['metadata'].get('deletionTimestamp'):
                    known.delete()
                return
            if known is not None:  # same name, new pod: the old one is gone
                known.delete()
            if self._closing.is_set() or (pod.get('status') or {}).get('phase') in ('Failed', 'Succeeded') \
                    or pod['metadata'].get('deletionTimestamp'):
                return
            if gates := (pod.get('spec') or {}).get('schedulingGates'):  # the scheduler leaves it Pending
                if self.gated.get(key) != pod['metadata']['uid']:
                    self.gated[key] = pod['metadata']['uid']
                    self.patch_status(pod, {'phase': 'Pending', 'conditions': [kubelet.condition(
                        'PodScheduled', False, 'SchedulingGated',
                        f'Scheduling is blocked due to non-empty scheduling gates: {[g["name"] for g in gates]}')]})
                return
            self.gated.pop(key, None)
            self.pods[key] = thread = PodThread(self, pod, next_pod_ip())
            self._every.append(thread)
        thread.start()

    def _deleted(self, pod: Obj) -> None:
        with self._lock:
            known = self.pods.get((pod['metadata']['namespace'], pod['metadata']['name']))
        if known is not None and known.uid == pod['metadata']['uid']:
            known.delete()

    # -- for the pod threads -------------------------------------------------------------------------
    def read(self, plural: str, namespace: str, name: str) -> Obj | None:
        """A ConfigMap or Secret (what a pod mounts or names in its env); None when there is none."""
        response = self.api.get(f'/api/v1/namespaces/{namespace}/{plural}/{name}')
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return response.json()

    def event(self, pod: Obj, reason: str, message: str, kind: str = 'Warning') -> None:
        """An Event on the pod from the kubelet, as `kubectl describe pod` lists them."""
        meta, at = pod['metadata'], now()
        self.api.post(f'/api/v1/namespaces/{meta["namespace"]}/events', json={
            'metadata': {'generateName': f'{meta["name"]}.', 'namespace': meta['namespace']},
            'involvedObject': {'apiVersion': 'v1', 'kind': 'Pod', 'name': meta['name'],
                               'namespace': meta['namespace'], 'uid': meta['uid']},
            'reason': reason, 'message': message, 'type': kind, 'count': 1, 'firstTimestamp': at,
            'lastTimestamp': at, 'source': {'component': 'kubelet', 'host': 'local'},
            'reportingComponent': 'kubelet', 'reportingInstance': 'local'}).raise_for_status()

    def patch_status(self, pod: Obj, status: Obj) -> bool:
        """Merge `status` into the pod's; False when the pod is gone (or replaced by a new one)."""
        meta = pod['metadata']
        path = f'/api/v1/namespaces/{meta["namespace"]}/pods/{meta["name"]}/status'
        current = self.api.get(path)
        if current.status_code == 404 or current.json()['metadata']['uid'] != meta['uid']:
            return False
        current.raise_for_status()
        response = self.api.patch(path, headers=MERGE, json={'status': status})
        if response.status_code == 404:
            return False
        response.raise_for_status()
        return True
