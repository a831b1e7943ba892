"""Spawn the real ``stage-runtime serve`` process and check what it leaves behind.

``StageProcess`` starts ``python -m stage_runtime serve`` with free ports (``--http-port 0 --zmq-port 0``;
the bound addresses are read from its log), waits for ``/ready``, records every descendant process while
it runs, and after it exits asserts that none of them survived and that it left no ``/dev/shm`` segment.

Other engineers' tests share this machine and its /dev/shm, so a segment counts as the stage's when one
of its processes mapped or opened it while tracked, or when its name carries one of their pids (the
multiprocess executor names segments ``ds-<pid>-…``) — not merely because it appeared meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from stage_runtime.process_tree import alive, descendants, proc_stat, segments_of, shm_segments, shm_used_by

REPO_ROOT = Path(__file__).resolve().parents[2]
TESTS_DIR = Path(__file__).resolve().parent            # executors_for_tests / adapters_for_tests live here
_LISTENING = re.compile(r"listening http=(\S+) zmq=(\S+)")


class StageProcess:
    def __init__(self, args: list[str], log_path: Path, termination_log: Path | None = None):
        self.args = list(args)
        self.log_path = log_path
        self.termination_log = termination_log
        self.proc: subprocess.Popen | None = None
        self.http_url = self.zmq_url = ""
        self.seen: dict[int, int] = {}
        self.shm_seen: set[str] = set()
        self._shm_before: set[str] = set()

    def start(self, wait_ready: bool = True, timeout: float = 120.0) -> StageProcess:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR)]))
        argv = [sys.executable, "-m", "stage_runtime", "serve", "--host", "127.0.0.1", "--http-port", "0",
                "--zmq-port", "0", *self.args]
        if self.termination_log is not None:
            argv += ["--termination-log", str(self.termination_log)]
        self._shm_before = shm_segments()
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        if wait_ready:
            self.wait_ready(timeout)
        return self

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_listening(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.http_url:
            match = _LISTENING.search(self.log)
            if match:
                self.http_url, self.zmq_url = match.group(1), match.group(2)
                return
            assert self.proc.poll() is None, f"stage exited with {self.proc.returncode}:\n{self.log[-3000:]}"
            assert time.monotonic() < deadline, f"stage not listening after {timeout} s:\n{self.log[-3000:]}"
            time.sleep(0.05)

    def wait_ready(self, timeout: float = 120.0) -> None:
        self.wait_listening(timeout)
        deadline = time.monotonic() + timeout
        while httpx.get(f"{self.http_url}/ready", timeout=5).status_code != 200:
            assert self.proc.poll() is None, f"stage exited with {self.proc.returncode}:\n{self.log[-3000:]}"
            assert time.monotonic() < deadline, f"stage not ready after {timeout} s:\n{self.log[-3000:]}"
            time.sleep(0.05)
        self.track()

    def track(self) -> None:
        """Remember the stage's descendants now (workers, helpers): none may outlive it."""
        self.seen.update(descendants(self.proc.pid))
        self.shm_seen |= shm_used_by([self.proc.pid, *self.seen])

    def signal(self, sig: int) -> None:
        self.track()
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"stage still running after {timeout} s:\n{self.log[-3000:]}") from None

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
        return self.wait(timeout)

    def assert_no_leaks(self) -> None:
        """After exit: no descendant survived (orphans), no new /dev/shm segment that nobody maps."""
        assert self.proc.poll() is not None, "the stage is still running"
        deadline = time.monotonic() + 5
        while True:
            left = alive(self.seen)
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert not left, f"orphan processes left by the stage: {left}"
        ours = segments_of(shm_segments() - self._shm_before, set(), [self.proc.pid, *self.seen])
        leaked = (self.shm_seen | ours) & shm_segments()
        assert not leaked, f"/dev/shm segments left by the stage: {sorted(leaked)}"

    def kill(self) -> None:
        """Last resort in fixture teardown (after a failed test): kill the stage and its descendants."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.track()
            self.proc.kill()
            self.proc.wait(10)
        for pid, start in self.seen.items():
            stat = proc_stat(pid)
            if stat is not None and stat[2] == start:          # the same process, not a reused pid
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
        self._log.close()


@contextlib.contextmanager
def running_stage(args: list[str], log_path: Path, ready_timeout: float = 120.0):
    """A started stage process for a fixture (ready within ``ready_timeout`` s: its warmup included); on exit
    SIGTERM → exit 0 and nothing left behind (killed whatever happened)."""
    stage = StageProcess(args, log_path)
    try:
        stage.start(timeout=ready_timeout)
        yield stage
        assert stage.stop() == 0, stage.log[-3000:]
        stage.assert_no_leaks()
    finally:
        stage.kill()
