"""Rank processes from the engine's side: how they start (fork server or spawn), how an exit reads, stopping, and
the last-resort cleanup."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import shutil
import signal
import socket
import time

from stage_runtime.executor import shm

KILL_GRACE_S = 2.0
# What the fork server imports once, before any rank: torch, diffusers and the runner (no CUDA context, no
# threads). Every rank forks from it instead of importing them again (seconds of CPU per rank).
WORKER_PRELOAD = ["stage_runtime.executor.fork_preload"]


def worker_context(method: str) -> multiprocessing.context.BaseContext:
    """The multiprocessing context ranks start in. ``forkserver``: one clean server process per engine process
    imports WORKER_PRELOAD, then forks each rank (it starts on first use and exits with its parent); ``spawn``:
    every rank is a fresh interpreter. Either way a rank begins with the engine process's environment as it is
    when the rank starts (``worker_proc.worker_main`` applies the snapshot the spec carries)."""
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(WORKER_PRELOAD)
    return ctx


def start_fork_server(executor: str, method: str) -> None:
    """Start the fork server now (``serve`` calls this first), so that its imports overlap the engine
    process's own instead of following them; a no-op unless the ranks will fork from it."""
    if executor == "mp" and method == "forkserver":
        worker_context(method)
        multiprocessing.forkserver.ensure_running()


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
