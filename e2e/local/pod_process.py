"""One pod as local processes: what a kubelet and a container runtime would do, mapped onto this machine.

The mapping (the only liberties the local cluster takes with a pod):
- **Network**: each pod gets its own loopback address as `status.podIP` (127.X.Y.Z; Linux routes all of
  127.0.0.0/8 to `lo`), and a `--host` argument is rewritten to it, so every pod listens on its declared
  container ports (8000, 5570) and the operator and the Service reach `podIP:containerPort` unchanged.
- **Files**: each volume mount becomes a folder under the pod's sandbox; an argument, an env value or the
  termination message path under a `mountPath` is rewritten into that folder. A `configMap` or `secret`
  volume is filled with the object's keys, read from the API when the pod starts (pod_config.py: `items`,
  modes, `optional`; a missing one is `NotReady`, the pod waits), an `emptyDir` starts empty and is shared by
  the pod's containers; an `emptyDir` mounted at /dev/shm is this machine's /dev/shm (segment names carry pids).
- **Image**: ignored; the `stage-runtime` command runs as `<this python> -m stage_runtime`. An image the
  node "has" (`LocalSources.images`: reference → folder) is that folder: an `image` volume mounts it, and a
  container running it sees it as its root (an absolute argument outside its mounts lands in it).
- **Storage**: a `persistentVolumeClaim` volume is the folder bound to that claim (`LocalSources.claims`),
  a `hostPath` the same path under the node's own folder (`LocalSources.node_root`: pods of one runner
  share a node, so they share it); `subPath` picks a folder inside; `readOnly` is not enforced.
- **Env**: `value`, the downward API (`fieldRef`: metadata.name/namespace/labels['k'], status.podIP), Secret and
  ConfigMap keys (`secretKeyRef`, `configMapKeyRef`, `envFrom`), over this process's environment (PATH, HOME,
  the venv). Anything else raises: nothing is silently skipped.
- **Logs**: a container's stdout and stderr go to its run's log file (container_logs.py: the kubelet's layout
  under the cluster's workdir, kept after the pod), which the API's `pods/log` serves to `kubectl logs`.

Each container runs in its own session (process group), so the whole group can be checked and ended.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e.local import pod_config
from e2e.local.container_logs import ContainerLogs, LogWriter, container_id, read_lines, render
from e2e.local.pod_config import NotReady, PodSpecError, Read

__all__ = ['LocalPod', 'LocalSources', 'NotReady', 'PodSpecError', 'end_groups', 'group_members', 'parent_pid',
           'proc_stat']

COMMANDS = {'stage-runtime': [sys.executable, '-m', 'stage_runtime']}
SHM = '/dev/shm'
_LABEL_REF = re.compile(r"metadata\.labels\['([^']+)'\]")

Obj = dict[str, Any]


@dataclass
class LocalSources:
    """What a node gets from elsewhere, as local folders: bound claims by name, images by reference, and the
    node's own disk (hostPath volumes)."""

    claims: dict[str, Path] = field(default_factory=dict)
    images: dict[str, Path] = field(default_factory=dict)
    node_root: Path | None = None

    def claim(self, name: str) -> Path:
        if name not in self.claims:
            raise PodSpecError(f'persistentVolumeClaim {name!r} is not bound to a local folder')
        return self.claims[name]

    def image(self, reference: str) -> Path:
        if reference not in self.images:
            raise PodSpecError(f'image {reference!r} is not on this node (no local folder for it)')
        return self.images[reference]

    def host_path(self, path: str) -> Path:
        if self.node_root is None:
            raise PodSpecError(f'hostPath {path!r}: this runner has no node folder')
        folder = self.node_root / path.lstrip('/')
        folder.mkdir(parents=True, exist_ok=True)
        return folder


class LocalPod:
    """A pod's sandbox (volumes, termination logs), its container processes and their logs. `read(plural,
    namespace, name)` reads a ConfigMap or Secret from the API (None: there is none)."""

    def __init__(self, pod: Obj, pod_ip: str, read: Read, root: Path, sources: LocalSources | None = None,
                 logs: ContainerLogs | None = None):
        self.pod, self.ip, self.read = pod, pod_ip, read
        self.sources = sources or LocalSources()
        self.namespace, self.name = pod['metadata']['namespace'], pod['metadata']['name']
        self.uid = pod['metadata'].get('uid', '')
        self.sandbox = Path(tempfile.mkdtemp(prefix=f'{self.name}-', dir=root))
        self.logs = logs or ContainerLogs(self.sandbox / 'logs')
        self.volumes: dict[str, Path | None] = {}
        self.process: subprocess.Popen | None = None
        self.groups: list[int] = []  # every container's process group (its pid), for the leak check
        self.writers: dict[str, list[LogWriter]] = {}  # container name → the log writer of each run

    # -- volumes and rewriting -----------------------------------------------------------------------
    def mount(self) -> None:
        """Make every volume a folder (`volumes`: name → host folder; None: /dev/shm as it is). NotReady when a
        ConfigMap or Secret is missing (nothing is written then; call again), PodSpecError for what cannot run."""
        mounts = [m for c in self._containers() for m in c.get('volumeMounts') or ()]
        out: dict[str, Path | None] = {}
        fills: list[tuple[str, dict[str, tuple[bytes, int]]]] = []
        for volume in self.pod['spec'].get('volumes') or ():
            name = volume['name']
            if 'emptyDir' in volume and any(m['name'] == name and m['mountPath'] == SHM for m in mounts):
                out[name] = None
            elif 'emptyDir' in volume:
                out[name] = self.sandbox / 'volumes' / name
            elif 'configMap' in volume or 'secret' in volume:
                out[name] = self.sandbox / 'volumes' / name
                fills.append((name, pod_config.volume_files(volume, self.namespace, self.read)))
            elif 'persistentVolumeClaim' in volume:
                out[name] = self.sources.claim(volume['persistentVolumeClaim']['claimName'])
            elif 'hostPath' in volume:
                out[name] = self.sources.host_path(volume['hostPath']['path'])
            elif 'image' in volume:
                out[name] = self.sources.image(volume['image']['reference'])
            else:
                raise PodSpecError(f'volume {name!r}: only emptyDir, configMap, secret, persistentVolumeClaim, '
                                   f'hostPath and image run locally: {sorted(volume)}')
        for name, folder in out.items():
            if folder is not None and folder.is_relative_to(self.sandbox):
                folder.mkdir(parents=True, exist_ok=True)
        for name, files in fills:
            pod_config.write_files(out[name], files)
        self.volumes = out

    def _containers(self) -> list[Obj]:
        spec = self.pod['spec']
        return list(spec.get('initContainers') or ()) + list(spec['containers'])

    def path_map(self, container: Obj) -> dict[str, str]:
        """mountPath → host folder for this container, plus its termination message path."""
        mapping = {}
        for mount in container.get('volumeMounts') or ():
            if mount['name'] not in self.volumes:
                raise PodSpecError(f'{container["name"]}: no volume {mount["name"]!r}')
            if (host := self.volumes[mount['name']]) is not None:
                mapping[mount['mountPath'].rstrip('/')] = str(host / mount['subPath'] if mount.get('subPath') else host)
        mapping[self.termination_path(container, pod_side=True)] = str(self.termination_path(container))
        return mapping

    def termination_path(self, container: Obj, pod_side: bool = False) -> Any:
        if pod_side:
            return container.get('terminationMessagePath') or '/dev/termination-log'
        return self.sandbox / f'termination-{container["name"]}.log'

    @staticmethod
    def rewrite(value: str, mapping: Mapping[str, str]) -> str:
        """A value equal to a mapped path or under it, mapped (the longest mount wins)."""
        for prefix in sorted(mapping, key=len, reverse=True):
            if (value == prefix and prefix) or value.startswith(prefix + '/'):
                return mapping[prefix] + value[len(prefix):]
        return value

    def argv(self, container: Obj) -> list[str]:
        command = list(container.get('command') or ()) + list(container.get('args') or ())
        if not command:
            raise PodSpecError(f'{container["name"]}: no command (the image entrypoint cannot run locally)')
        mapping = self.path_map(container)
        if (image := self.sources.images.get(container.get('image', ''))) is not None:
            mapping.setdefault('', str(image))  # the image's own files: every other absolute path
        argv = [self.rewrite(arg, mapping) for arg in command]
        for i, arg in enumerate(argv[:-1]):
            if arg == '--host':
                argv[i + 1] = self.ip
        return COMMANDS.get(argv[0], [argv[0]]) + argv[1:]

    def env(self, container: Obj) -> dict[str, str]:
        """This process's environment, then `envFrom`, then `env` (a later one wins, as in a container). NotReady
        when a Secret or ConfigMap key it names is missing (the kubelet's CreateContainerConfigError)."""
        mapping, env, name = self.path_map(container), dict(os.environ), container['name']
        for source in container.get('envFrom') or ():
            env.update(pod_config.env_from(name, source, self.namespace, self.read))
        for var in container.get('env') or ():
            source = var.get('valueFrom') or {}
            if 'value' in var:
                env[var['name']] = self.rewrite(str(var['value']), mapping)
            elif path := (source.get('fieldRef') or {}).get('fieldPath'):
                env[var['name']] = self._field(path)
            elif 'secretKeyRef' in source or 'configMapKeyRef' in source:
                if (value := pod_config.env_value(name, var, self.namespace, self.read)) is not None:
                    env[var['name']] = value
            elif not source:
                env[var['name']] = ''  # a variable with neither value nor valueFrom is set, empty
            else:
                raise PodSpecError(f'{name}: env {var["name"]!r}: only value, fieldRef, secretKeyRef and '
                                   f'configMapKeyRef run locally: {sorted(source)}')
        return env

    def _field(self, path: str) -> str:
        meta = self.pod['metadata']
        if match := _LABEL_REF.fullmatch(path):
            return (meta.get('labels') or {}).get(match[1], '')
        fields = {'metadata.name': self.name, 'metadata.namespace': self.namespace, 'status.podIP': self.ip,
                  'metadata.uid': meta.get('uid', '')}
        if path not in fields:
            raise PodSpecError(f'fieldRef {path!r} is not emulated')
        return fields[path]

    # -- processes -----------------------------------------------------------------------------------
    def start(self, container: Obj, run: int = 0) -> subprocess.Popen:
        """Start the container's run number `run` (its restartCount), its stdout and stderr into that run's log.
        NotReady (nothing started) when its env names a missing Secret or ConfigMap key."""
        argv, env = self.argv(container), self.env(container)
        self.termination_path(container).unlink(missing_ok=True)  # each run writes its own message
        writer = self.logs.writer(self.log_path(container, run))
        try:
            process = subprocess.Popen(argv, env=env, cwd=self.sandbox, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        except BaseException:
            writer.close()
            raise
        writer.attach(process)
        self.groups.append(process.pid)
        self.writers.setdefault(container['name'], []).append(writer)
        return process

    def log_path(self, container: Obj, run: int) -> Path:
        return self.logs.path(self.namespace, self.name, self.uid, container['name'], run)

    def container_id(self, container: Obj, run: int) -> str:
        return container_id(self.uid, container['name'], run)

    def finish_log(self, container: Obj, timeout: float = 5.0) -> None:
        """After the container exited: wait (up to `timeout` s) until its last lines are in its log."""
        for writer in self.writers.get(container['name'], ()):
            writer.close(timeout)

    def log(self, container: Obj, tail: int = 3000) -> str:
        """The end of the latest run's log, as `kubectl logs` prints it."""
        runs = self.writers.get(container['name'])
        return render(read_lines(runs[-1].path)).decode('utf-8', 'replace')[-tail:] if runs else ''

    def termination_message(self, container: Obj) -> str:
        path = self.termination_path(container)
        return path.read_text(errors='replace').strip()[:4096] if path.exists() else ''

    def stop(self, grace: float) -> list[int]:
        """SIGTERM the running container, SIGKILL it after `grace`; then end whatever is left of its process
        groups and return those pids (a clean stage leaves none: its workers go with it)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        left = end_groups(self.groups)
        for writer in (w for runs in self.writers.values() for w in runs):
            writer.close()  # the pipes' holders are gone: every log is complete
        return left


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, pgrp, …); None once the process is gone
    (a process that exits between the open and the read raises ESRCH: every OSError means gone)."""
    try:
        text = Path(f'/proc/{pid}/stat').read_text()
    except OSError:
        return None
    return text[text.rindex(')') + 2:].split()


def parent_pid(pid: int) -> int | None:
    """The parent of a live process; None once it is gone."""
    fields = proc_stat(pid)
    return None if fields is None else int(fields[1])


def group_members(groups: list[int]) -> list[int]:
    """Live (non-zombie) processes in these process groups."""
    members = []
    for entry in filter(str.isdigit, os.listdir('/proc')):
        fields = proc_stat(int(entry))
        if fields is not None and int(fields[2]) in groups and fields[0] != 'Z':
            members.append(int(entry))
    return members


def end_groups(groups: list[int], settle: float = 5.0) -> list[int]:
    """Wait up to `settle` s for the groups to empty by themselves; SIGKILL and return what was left."""
    deadline = time.monotonic() + settle
    while (left := group_members(groups)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue  # gone between the scan and the kill
    return left
