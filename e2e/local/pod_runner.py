"""A local kubelet for the emulated API: every pod it sees runs as local processes (see pod_process.py).

`PodRunner(base_url).start()` watches pods in every namespace. For a new pod it runs the init containers
in order, then the container; it reports what a kubelet reports into `status` — podIP, Pending with
initContainerStatuses, Running, the Ready condition from the readiness probe's HTTP GET (polled), and on
exit phase Failed (or Succeeded) with the exit code and the termination message read from the container's
termination log. A deleted pod's process gets SIGTERM after its preStop sleep (the only preStop action
emulated), SIGKILL at the end of the pod's grace period; processes
that outlive their container are killed and recorded in `leftovers` (a clean stage leaves none).
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
from e2e.local.kubelet import now
from e2e.local.pod_process import LocalPod, LocalSources, PodSpecError

log = logging.getLogger(__name__)
MERGE = {'Content-Type': 'application/merge-patch+json'}
PROBE_PERIOD = 0.25  # seconds; a real kubelet's period is the probe's periodSeconds (5 s here)
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
    def __init__(self, base_url: str, root: Path | None = None):
        self.base_url = base_url
        # absolute: each pod runs in a sandbox of its own as working directory, so a relative root (make cluster's
        # default --workdir .cluster) would make every volume path miss
        self.root = Path(tempfile.mkdtemp(prefix='pod-runner-', dir=root)).resolve()
        self.api = httpx.Client(base_url=base_url, timeout=10)
        self.pods: dict[tuple[str, str], _PodThread] = {}
        self._every: list[_PodThread] = []  # every pod ever run, also those replaced by a new pod of the same name
        self.leftovers: dict[str, list[int]] = {}  # pod → processes that outlived its container
        self.gated: dict[tuple[str, str], str] = {}  # pods held by scheduling gates (not started): key → uid
        self.errors: list[str] = []  # the runner's own failures (a pod it could not run is reported in its status)
        # claims, images and the node's disk as local folders (tests bind claims and "pull" images here)
        self.sources = LocalSources(node_root=self.root / 'node-local')
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
            self.pods[key] = thread = _PodThread(self, pod, next_pod_ip())
            self._every.append(thread)
        thread.start()

    def _deleted(self, pod: Obj) -> None:
        with self._lock:
            known = self.pods.get((pod['metadata']['namespace'], pod['metadata']['name']))
        if known is not None and known.uid == pod['metadata']['uid']:
            known.delete()

    # -- for the pod threads -------------------------------------------------------------------------
    def read_configmap(self, namespace: str, name: str) -> Obj | None:
        response = self.api.get(f'/api/v1/namespaces/{namespace}/configmaps/{name}')
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return response.json()

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


def _pre_stop_sleep(pod: Obj) -> float:
    """The main container's `lifecycle.preStop.sleep.seconds` (the only preStop action emulated), else 0."""
    container = pod['spec']['containers'][0]
    return float((((container.get('lifecycle') or {}).get('preStop') or {}).get('sleep') or {}).get('seconds', 0))


class _PodThread(threading.Thread):
    """One pod's life: init containers, the container, readiness, exit or deletion."""

    def __init__(self, runner: PodRunner, pod: Obj, ip: str):
        super().__init__(name=f'pod-{pod["metadata"]["name"]}', daemon=True)
        self.runner, self.pod, self.ip, self.uid = runner, pod, ip, pod['metadata']['uid']
        self.deleted = threading.Event()
        self.local: LocalPod | None = None

    def delete(self) -> None:
        self.deleted.set()

    def run(self) -> None:
        try:
            self._run()
        except (PodSpecError, OSError) as exc:  # the pod cannot run here: say so in its status, like a kubelet
            self.runner.patch_status(self.pod, {'phase': 'Failed', 'reason': 'LocalRunError', 'message': str(exc)})
        except Exception as exc:  # an API failure or a runner bug: recorded for the test, then raised
            self.runner.errors.append(f'{self.pod["metadata"]["name"]}: {exc!r}')
            raise
        finally:
            if self.local is not None:
                grace = float(self.pod['spec'].get('terminationGracePeriodSeconds', 30))
                process = getattr(self.local, 'process', None)
                deleted = self.deleted.is_set() and not self.runner._closing.is_set()  # not the cluster's teardown
                if deleted and process is not None and process.poll() is None:
                    pause = min(grace, _pre_stop_sleep(self.pod))  # gone from the API (and the Service) already,
                    grace -= pause                                 # still serving: the preStop hook's sleep
                    time.sleep(pause)
                if left := self.local.stop(grace):
                    self.runner.leftovers[self.local.name] = left

    def _report(self, **status: Any) -> bool:
        return not self.deleted.is_set() and self.runner.patch_status(self.pod, status)

    def _run(self) -> None:
        spec = self.pod['spec']
        self.local = LocalPod(self.pod, self.ip, self.runner.read_configmap, self.runner.root, self.runner.sources)
        started = now()
        scheduled = kubelet.condition('PodScheduled', True, at=started)
        if not self._report(phase='Pending', podIP=self.ip, podIPs=[{'ip': self.ip}], hostIP='127.0.0.1',
                            startTime=started, conditions=[scheduled]):
            return
        init_statuses: list[Obj] = []
        for container in spec.get('initContainers') or ():
            began = now(millis=True)
            running = kubelet.running_container(container['name'], False, began, container.get('image', ''))
            if not self._report(initContainerStatuses=[*init_statuses, running]):
                return
            code = self._run_to_end(container)
            if code is None:
                return
            init_statuses.append(kubelet.terminated_container(container['name'], code,
                                                              self.local.termination_message(container),
                                                              container.get('image', ''), started=began))
            if code != 0:
                self._report(phase='Failed', initContainerStatuses=init_statuses, conditions=[
                    scheduled, kubelet.condition('Initialized', False, 'InitContainersFailed')])
                return
        container = spec['containers'][0]
        self.local.process = self.local.start(container)
        ready = False
        image = container.get('image', '')
        if not self._report(phase='Running', initContainerStatuses=init_statuses or None,
                            conditions=[scheduled, kubelet.condition('Initialized', True),
                                        kubelet.condition('Ready', False)],
                            containerStatuses=[kubelet.running_container(container['name'], False, now(), image)]):
            return
        started = now()
        while not self.deleted.wait(PROBE_PERIOD):
            code = self.local.process.poll()
            if code is not None:
                message = self.local.termination_message(container) or self.local.log(container, 1000)
                self._report(phase='Succeeded' if code == 0 else 'Failed',
                             conditions=[scheduled, kubelet.condition('Initialized', True),
                                         kubelet.condition('Ready', False)],
                             containerStatuses=[kubelet.terminated_container(container['name'], code, message, image)])
                return
            if (probe := self._probe(container)) != ready:
                ready = probe
                self._report(conditions=[scheduled, kubelet.condition('Initialized', True),
                                         kubelet.condition('Ready', ready)],
                             containerStatuses=[kubelet.running_container(container['name'], ready, started, image)])

    def _run_to_end(self, container: Obj) -> int | None:
        """Run an init container to its end; None if the pod was deleted meanwhile."""
        self.local.process = self.local.start(container)
        while not self.deleted.wait(PROBE_PERIOD):
            if (code := self.local.process.poll()) is not None:
                self.local.process = None
                return code
        return None

    def _probe(self, container: Obj) -> bool:
        probe = (container.get('readinessProbe') or {}).get('httpGet')
        if probe is None:
            return True
        port = probe['port']
        if isinstance(port, str):
            port = next(p['containerPort'] for p in container.get('ports') or () if p.get('name') == port)
        try:
            return httpx.get(f'http://{self.ip}:{port}{probe.get("path", "/")}', timeout=2).status_code == 200
        except httpx.HTTPError:
            return False  # not listening yet: a failed probe, as a kubelet counts it
