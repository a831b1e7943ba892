"""One pod's life on the local kubelet (the pod runner starts a `PodThread` for each pod it sees), and what a
kubelet reports of it into `pod.status`.

- Volumes first. A missing ConfigMap or Secret (not `optional`) keeps the pod Pending, its containers waiting
  (ContainerCreating; PodInitializing with init containers), and a `FailedMount` Event on the pod says which
  volume and which object (`kubectl describe pod`); tried again every second until it appears or the pod goes.
- Init containers in order, then the container (one per pod). A container whose env names a missing Secret or
  ConfigMap key waits (CreateContainerConfigError with the kubelet's message, Event `Failed`), tried again.
- `restartPolicy` (Always by default, OnFailure, Never): a container that exits and should restart runs again as
  the next run (restartCount + 1, lastState the run that ended) after a back-off: at once the first time, then
  1 s doubling to 20 s (a kubelet: 10 s doubling to 5 min), CrashLoopBackOff meanwhile. A failed init container
  runs again the same way unless the policy is Never (then the pod fails). Stage pods are Never: the operator
  replaces a failed replica with a new pod.
- Each run's stdout and stderr go to a log file of its own (container_logs.py), named by its containerID; the
  termination message comes from the termination log (or, with FallbackToLogsOnError, the log's end).
- Deletion: SIGTERM after the preStop sleep, SIGKILL at the end of the grace period (pod_process.LocalPod.stop).
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import httpx

from e2e.local import kubelet
from e2e.local.kubelet import now
from e2e.local.pod_process import LocalPod, NotReady, PodSpecError

if TYPE_CHECKING:
    from e2e.local.pod_runner import PodRunner

PROBE_PERIOD = 0.25  # seconds; a real kubelet's period is the probe's periodSeconds (5 s here)
RETRY = 1.0  # seconds between tries of a missing Secret or ConfigMap
BACKOFF, BACKOFF_MAX = 1.0, 20.0
Obj = dict[str, Any]


def backoff(restarts: int) -> float:
    """Seconds before the next run of a container that has been restarted `restarts` times."""
    return 0.0 if restarts == 0 else min(BACKOFF * 2 ** (restarts - 1), BACKOFF_MAX)


def _pre_stop_sleep(pod: Obj) -> float:
    """The main container's `lifecycle.preStop.sleep.seconds` (the only preStop action emulated), else 0."""
    container = pod['spec']['containers'][0]
    return float((((container.get('lifecycle') or {}).get('preStop') or {}).get('sleep') or {}).get('seconds', 0))


class PodThread(threading.Thread):
    """One pod's life: volumes, init containers, the container, readiness, restarts, exit or deletion."""

    def __init__(self, runner: PodRunner, pod: Obj, ip: str):
        super().__init__(name=f'pod-{pod["metadata"]["name"]}', daemon=True)
        self.runner, self.pod, self.ip, self.uid = runner, pod, ip, pod['metadata']['uid']
        self.policy = pod['spec'].get('restartPolicy') or 'Always'
        self.deleted = threading.Event()
        self.local: LocalPod | None = None
        self.init_statuses: list[Obj] = []
        self.main_status: Obj = {}
        self.initialized, self.ready = False, False
        self._told: set[tuple[str, str]] = set()  # the Events posted (each once)

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

    # -- reporting -----------------------------------------------------------------------------------
    def _report(self, **status: Any) -> bool:
        return not self.deleted.is_set() and self.runner.patch_status(self.pod, status)

    def _conditions(self) -> list[Obj]:
        return [kubelet.condition('PodScheduled', True, at=self.scheduled_at),
                kubelet.condition('Initialized', self.initialized),
                kubelet.condition('Ready', self.ready)]

    def _show(self, index: int | None, entry: Obj, **status: Any) -> bool:
        """Report one container's status (`index`: an init container's; None: the container's) with the pod's."""
        if index is None:
            self.main_status = entry
        else:
            self.init_statuses[index] = entry
        return self._report(**{'initContainerStatuses': self.init_statuses or None,
                               'containerStatuses': [self.main_status], 'conditions': self._conditions(), **status})

    def _event(self, reason: str, message: str) -> None:
        if (reason, message) not in self._told:
            self._told.add((reason, message))
            self.runner.event(self.pod, reason, message)

    # -- the life ------------------------------------------------------------------------------------
    def _run(self) -> None:
        spec = self.pod['spec']
        if len(spec['containers']) != 1:
            raise PodSpecError(f'{len(spec["containers"])} containers: one container per pod runs locally')
        if any(c.get('restartPolicy') for c in spec.get('initContainers') or ()):
            raise PodSpecError('an init container with a restartPolicy (a sidecar) does not run locally')
        self.local = LocalPod(self.pod, self.ip, self.runner.read, self.runner.root, self.runner.sources,
                              self.runner.logs)
        self.scheduled_at = now()
        inits, main = list(spec.get('initContainers') or ()), spec['containers'][0]
        self.init_statuses = [kubelet.waiting_container(c['name'], 'PodInitializing', image=c.get('image', ''))
                              for c in inits]
        if not self._show(None, kubelet.waiting_container(main['name'], 'PodInitializing' if inits else
                                                          'ContainerCreating', image=main.get('image', '')),
                          phase='Pending', podIP=self.ip, podIPs=[{'ip': self.ip}], hostIP='127.0.0.1',
                          startTime=self.scheduled_at):
            return
        if not self._mount():
            return
        for index, container in enumerate(inits):
            if not self._run_container(container, index):
                return
        self.initialized = True
        self._run_container(main, None)

    def _mount(self) -> bool:
        while True:
            try:
                self.local.mount()
                return True
            except NotReady as exc:  # the kubelet tries again; the Event says why the pod does not start
                self._event(exc.reason, exc.message)
                if self.deleted.wait(RETRY):
                    return False

    def _run_container(self, container: Obj, index: int | None) -> bool:
        """Run a container (`index`: init container number; None: the container) until it ends for good, restarted
        as `restartPolicy` says; True when an init container succeeded, False when the pod is done or deleted."""
        name, image, run, last = container['name'], container.get('image', ''), 0, None
        while True:
            if not self._start(container, index, run, last):
                return False
            started, cid = now(millis=index is not None), self.local.container_id(container, run)
            self.ready = False
            if not self._show(index, kubelet.running_container(name, False, started, image, run, cid, last),
                              phase='Running' if index is None else 'Pending'):
                return False
            code = self._wait(container, index, started, run, cid, last)
            if code is None:
                return False
            self.local.process, self.ready = None, False
            self.local.finish_log(container)
            fallback = container.get('terminationMessagePolicy') == 'FallbackToLogsOnError' and code != 0
            message = self.local.termination_message(container) or (self.local.log(container, 1000) if fallback
                                                                      else '')
            ended = kubelet.terminated_container(name, code, message, image, started=started if index is not None
                                                 else None, restart_count=run, container_id=cid, last=last)
            again = self.policy == 'Always' if code == 0 else self.policy != 'Never'
            if index is not None and code == 0:  # an init container that succeeded: the next one
                return self._show(index, ended)
            if not again:
                self._show(index, ended, phase='Succeeded' if code == 0 else 'Failed', **(
                    {} if index is None else {'conditions': self._conditions()[:1] + [kubelet.condition(
                        'Initialized', False, 'InitContainersFailed')]}))
                return False
            last = {'terminated': ended['state']['terminated']}
            if delay := backoff(run):
                message = f'back-off {delay:g}s restarting failed container={name} pod={self.local.name}_' \
                          f'{self.local.namespace}({self.uid})'
                self._show(index, kubelet.waiting_container(name, 'CrashLoopBackOff', message, image, run, last))
                self._event('BackOff', f'Back-off restarting failed container {name} in pod {self.local.name}_'
                                       f'{self.local.namespace}({self.uid})')
                if self.deleted.wait(delay):
                    return False
            run += 1

    def _start(self, container: Obj, index: int | None, run: int, last: Obj | None) -> bool:
        """Start a run; while its env names a missing Secret or ConfigMap key, wait as a kubelet does."""
        while True:
            try:
                self.local.process = self.local.start(container, run)
                return True
            except NotReady as exc:
                self._event('Failed', f'Error: {exc.message}')
                entry = kubelet.waiting_container(container['name'], exc.reason, exc.message,
                                                  container.get('image', ''), run, last)
                if entry != (self.main_status if index is None else self.init_statuses[index]):
                    self._show(index, entry)
                if self.deleted.wait(RETRY):
                    return False

    def _wait(self, container: Obj, index: int | None, started: str, run: int, cid: str,
              last: Obj | None) -> int | None:
        """The exit code of the running process; None if the pod was deleted first. The container's readiness
        probe is polled meanwhile."""
        while not self.deleted.wait(PROBE_PERIOD):
            if (code := self.local.process.poll()) is not None:
                return code
            if index is None and (probe := self._probe(container)) != self.ready:
                self.ready = probe
                self._show(None, kubelet.running_container(container['name'], probe, started,
                                                           container.get('image', ''), run, cid, last))
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
