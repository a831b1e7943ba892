"""Rank processes from the engine's side: how an exit reads, stopping, and the last-resort cleanup."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import time

from stage_runtime.executor import shm

KILL_GRACE_S = 2.0


def describe_exit(rank: int, pid: int | None, exitcode: int | None) -> str:
    """``rank 1 (pid 4242) killed by signal 9 (SIGKILL)`` / ``… exited with code 3``."""
    if exitcode is not None and exitcode < 0:
        try:
            name = f" ({signal.Signals(-exitcode).name})"
        except ValueError:
            name = ""
        return f"rank {rank} (pid {pid}) killed by signal {-exitcode}{name}"
    return f"rank {rank} (pid {pid}) exited with code {exitcode}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_all(procs: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))


def signal_all(procs: list, sig: int) -> None:
    for p in procs:
        try:
            os.kill(p.pid, sig)
        except ProcessLookupError:
            continue                            # exited (and was reaped) in the meantime


def last_resort(procs: list, shm_prefix: str, ipc_dir: str) -> None:
    """At interpreter exit without shutdown(): no rank, segment or socket file may outlive us."""
    live = [p for p in procs if p.is_alive()]
    signal_all(live, signal.SIGKILL)
    join_all(live, KILL_GRACE_S)
    shm.sweep(shm_prefix)
    shutil.rmtree(ipc_dir, ignore_errors=True)


def recv_or_none(conn) -> dict | None:
    try:
        return conn.recv() if conn.poll() else None
    except (EOFError, OSError):
        return None
    finally:
        conn.close()
