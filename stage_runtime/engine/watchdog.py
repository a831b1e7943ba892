"""StepWatchdog: notices a running request that makes no progress.

The engine tells it when an executor call begins and ends and when a step (or a phase) completes. While a
call runs and nothing has progressed for ``stall_unready_s``, :meth:`stalled` names the requests and the
step they are stuck in (``/ready`` answers 503 with it, so the Service stops routing here); once progress
resumes it clears. Past ``stall_fail_s`` the watchdog calls ``on_fail`` once with the reason: the engine
fails closed (exit 3, ``StepStalled``) and the operator restarts the replica. An idle engine never stalls.
Abort cannot help a stalled step: aborts act at step boundaries, and a stalled step never reaches one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from stage_runtime.config import LimitsConfig

log = logging.getLogger(__name__)

MIN_POLL_S, MAX_POLL_S = 0.05, 5.0


class StepWatchdog:
    def __init__(self, limits: LimitsConfig, on_fail: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic):
        self.unready_s, self.fail_s = limits.stall_unready_s, limits.stall_fail_s
        self._on_fail, self._clock = on_fail, clock
        self._lock = threading.Lock()
        self._ids: tuple[str, ...] = ()
        self._since: float | None = None       # the last progress of the running call (None: idle)
        self._where = "in its first step"
        self._failed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what the engine reports -------------------------------------------------------------------------
    def begin(self, request_ids: Sequence[str]) -> None:
        with self._lock:
            self._ids, self._since, self._where = tuple(request_ids), self._clock(), "in a step"

    def progress(self, step_index: int, num_steps: int, phase: str = "denoise") -> None:
        with self._lock:
            if self._since is not None:
                self._since = self._clock()
                if phase == "encode":
                    self._where = "encoding the prompt, before step 1"
                elif phase == "denoise" and step_index < num_steps:
                    self._where = f"in step {step_index + 1} of {num_steps}"
                else:
                    self._where = "after its last step (decoding)"

    def end(self) -> None:
        with self._lock:
            self._ids, self._since = (), None

    def running(self) -> tuple[str, ...]:
        """The requests inside an executor call now (a step, or a whole request-mode run)."""
        with self._lock:
            return self._ids

    # -- verdicts ----------------------------------------------------------------------------------------
    def stalled_for(self) -> float:
        """Seconds the running call has made no progress (0 when idle)."""
        with self._lock:
            return 0.0 if self._since is None else max(0.0, self._clock() - self._since)

    def stalled(self) -> str | None:
        """Why this replica should not get new work, or None: no progress for at least ``stall_unready_s``."""
        if self.unready_s is None:
            return None
        idle = self.stalled_for()
        if idle < self.unready_s:
            return None
        return self._describe(idle)

    def check(self) -> bool:
        """Fail closed once past ``stall_fail_s``; True when it did (now or before)."""
        if self._failed:
            return True
        if self.fail_s is None:
            return False
        idle = self.stalled_for()
        if idle < self.fail_s:
            return False
        self._failed = True
        reason = f"{self._describe(idle)}; past stall_fail_s={self.fail_s:g} the replica fails closed"
        log.error("step stalled: %s", reason)
        self._on_fail(reason)
        return True

    def _describe(self, idle: float) -> str:
        with self._lock:
            ids, where = ", ".join(self._ids) or "-", self._where
        return f"no step progress for {idle:.0f} s (requests {ids}, {where})"

    # -- the thread ----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Watch in a daemon thread (armed once the engine is ready; a no-op when both bounds are off)."""
        if self._thread is None and (self.unready_s is not None or self.fail_s is not None):
            self._thread = threading.Thread(target=self._run, name="step-watchdog", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        bounds = [b for b in (self.unready_s, self.fail_s) if b is not None]
        poll = min(MAX_POLL_S, max(MIN_POLL_S, min(bounds) / 8))
        while not self._stop.wait(poll):
            if self.check():
                return

    def stop(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(2 * MAX_POLL_S)
