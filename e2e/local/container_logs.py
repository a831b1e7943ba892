"""Container logs as a node keeps them: one file per container run, kept after the pod and the cluster are gone.

The layout is a kubelet's `/var/log/pods`, under the local cluster's workdir (`make cluster`: `.cluster/logs`):

    <root>/<namespace>_<pod>_<pod uid>/<container>/<run>.log     run: the container's restartCount (0, 1, ...)

A pod recreated under the same name (the operator replaces a failed replica so) has another uid, so the log
of every pod that ever ran stays apart. Each line is in the CRI logging format, as containerd writes it:

    2026-05-01T12:00:00.123456789Z stderr F INFO stage ready on 127.100.0.2:8000
    <time RFC3339, ns>             <stream> <F: a full line, P: a part of a longer one> <the text>

`LogWriter` copies a process's stdout and stderr into such a file (a thread per pipe, each line stamped when it
arrives); `read_lines`/`render` give back what `kubectl logs` prints (the text; the time too with
`--timestamps`). `ContainerLogs` knows which files are still being written, so a follow ends when its writer
closes: when the container has exited and every process holding its pipes is gone.
"""
from __future__ import annotations

import datetime
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

LINE_LIMIT = 16 * 1024  # longer lines are split into P (partial) records, as containerd does


def timestamp(ns: int | None = None) -> str:
    """RFC 3339 with nanoseconds, UTC: what a container runtime stamps each log line with."""
    ns = time.time_ns() if ns is None else ns
    return time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(ns // 10**9)) + f'.{ns % 10**9:09d}Z'


def parse_time(text: str) -> float:
    """Seconds since the epoch of an RFC 3339 time (`Z` or an offset; any number of fraction digits)."""
    text = text.strip().replace('z', 'Z')
    main, _, rest = text.partition('.')
    fraction, zone = '', text[len(main):]
    if rest:
        digits = len(rest) - len(rest.lstrip('0123456789'))
        fraction, zone = rest[:digits], rest[digits:]
    zone = '+00:00' if zone == 'Z' else zone
    stamp = datetime.datetime.fromisoformat(main + zone)
    return stamp.timestamp() + (float(f'0.{fraction}') if fraction else 0.0)


def container_id(pod_uid: str, container: str, run: int) -> str:
    """`status.containerStatuses[].containerID` of a run: the pod, the container and the run, which name its log."""
    return f'local://{pod_uid}/{container}/{run}'


def run_of(container_id: str, pod_uid: str, container: str) -> int | None:
    """The run a containerID names, if it is one of this pod's container's; None otherwise."""
    prefix = f'local://{pod_uid}/{container}/'
    rest = container_id[len(prefix):] if container_id.startswith(prefix) else ''
    return int(rest) if rest.isdigit() else None


@dataclass(frozen=True)
class Line:
    time: str
    stream: str
    partial: bool
    text: bytes


def parse(data: bytes) -> tuple[list[Line], int]:
    """The complete records at the start of `data`, and how many bytes they took (a record being written stays)."""
    lines, start = [], 0
    while (end := data.find(b'\n', start)) != -1:
        fields = data[start:end].split(b' ', 3)
        start = end + 1
        if len(fields) < 3:
            continue  # not a record (a file edited by hand): skipped, as a kubelet skips it
        lines.append(Line(fields[0].decode(), fields[1].decode(), fields[2] == b'P',
                          fields[3] if len(fields) == 4 else b''))
    return lines, start


def read_lines(path: Path) -> list[Line]:
    return parse(path.read_bytes())[0] if path.exists() else []


def render(lines: list[Line], timestamps: bool = False) -> bytes:
    return b''.join((line.time.encode() + b' ' if timestamps else b'') + line.text + (b'' if line.partial else b'\n')
                    for line in lines)


def tail(lines: list[Line], count: int) -> list[Line]:
    """The last `count` lines, a line being a run of P records ended by an F record."""
    if count <= 0:
        return []
    ends = [i for i, line in enumerate(lines) if not line.partial]
    return lines[ends[-count - 1] + 1:] if len(ends) > count else lines


def since(lines: list[Line], seconds_since_epoch: float) -> list[Line]:
    return [line for line in lines if parse_time(line.time) >= seconds_since_epoch]


class ContainerLogs:
    """The node's log folder, and which of its files are still written."""

    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        self._open: set[Path] = set()
        self._lock = threading.Lock()

    def path(self, namespace: str, pod: str, uid: str, container: str, run: int) -> Path:
        return self.root / f'{namespace}_{pod}_{uid}' / container / f'{run}.log'

    def writer(self, path: Path) -> LogWriter:
        with self._lock:
            self._open.add(path)
        return LogWriter(path, self._closed)

    def is_open(self, path: Path) -> bool:
        with self._lock:
            return path in self._open

    def _closed(self, path: Path) -> None:
        with self._lock:
            self._open.discard(path)


class LogWriter:
    """Copies a process's stdout and stderr (pipes) into one log file, a line at a time."""

    def __init__(self, path: Path, on_close: Callable[[Path], None] | None = None):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self._on_close = path, on_close
        self._file = open(path, 'ab')
        self._lock = threading.Lock()
        self._pumps: list[threading.Thread] = []
        self._closed = False

    def attach(self, process: subprocess.Popen) -> None:
        for pipe, stream in ((process.stdout, b'stdout'), (process.stderr, b'stderr')):
            pump = threading.Thread(target=self._pump, args=(pipe, stream), name=f'log-{self.path.parent.name}',
                                    daemon=True)
            pump.start()
            self._pumps.append(pump)

    def _pump(self, pipe: IO[bytes], stream: bytes) -> None:
        with pipe:
            while chunk := pipe.readline(LINE_LIMIT):
                full = chunk.endswith(b'\n')
                tag = b'F' if full or len(chunk) < LINE_LIMIT else b'P'  # short and unended: the last line at EOF
                record = b' '.join((timestamp().encode(), stream, tag, chunk[:-1] if full else chunk)) + b'\n'
                with self._lock:
                    self._file.write(record)
                    self._file.flush()

    def close(self, timeout: float = 5.0) -> bool:
        """Wait up to `timeout` s for the pipes to end (every process holding them gone); True once the file is
        complete and closed. Idempotent; False while a process still holds a pipe (call again after ending it)."""
        deadline = time.monotonic() + timeout
        for pump in self._pumps:
            pump.join(max(0.0, deadline - time.monotonic()))
        if any(pump.is_alive() for pump in self._pumps):
            return False
        with self._lock:
            if not self._closed:
                self._closed = True
                self._file.close()
                if self._on_close is not None:
                    self._on_close(self.path)
        return True
