"""When the stage sleeps and wakes (``sleep:`` in the config; the ranks' half is ``worker.sleep``).

The engine holds its scheduling while ``gated``: from the moment a sleep is decided (nothing running), through the
sleep, until the wake has brought every rank's weights back. Requests that arrive meanwhile queue, and start a wake
(:meth:`SleepControl.wake_soon`): a generation route waits for it at most ``wake_timeout_s`` (then 503 with
Retry-After), a job or a ZMQ request simply waits in the queue. Sleep and wake are collective RPCs on the engine's
busy-loop thread, every rank together; a rank that dies in either fails the engine closed like any worker death.

After ``after_idle_s`` without work the stage sleeps itself at ``level`` (:meth:`run_idle_timer`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from stage_runtime.config import StageConfig
from stage_runtime.config.sleep import level_2_refusal
from stage_runtime.errors import EngineDeadError, InvalidRequestError, RpcError, StageBusyError

log = logging.getLogger(__name__)


class SleepControl:
    def __init__(self, engine, config: StageConfig):
        self.engine = engine
        self.config = config.sleep
        self.refusal_2 = level_2_refusal(config)
        self.level: int | None = None          # asleep at this level
        self.gated = False                     # the engine schedules nothing (asleep, falling asleep, waking)
        self.sleeps_total = self.wakes_total = 0
        self.last_wake_s: float | None = None
        self.on_wake: list[Callable[[float], None]] = []     # observers of each wake's seconds (the histogram)
        self.activity = 0                      # requests admitted so far (the idle timer's clock)
        self._op = threading.Lock()            # one sleep or wake at a time
        self._awake = threading.Event()
        self._awake.set()
        self._waker: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def is_sleeping(self) -> bool:
        return self.level is not None

    def view(self) -> dict:
        return {"is_sleeping": self.is_sleeping, "level": self.level, "sleeps_total": self.sleeps_total,
                "wakes_total": self.wakes_total, "last_wake_s": self.last_wake_s}

    def check_enabled(self) -> None:
        if not self.config.enabled:
            raise RpcError("sleep mode is off on this stage (serve --enable-sleep-mode; the CRD's spec.sleep)")

    def check_level(self, level: object) -> int:
        if level not in (1, 2):
            raise InvalidRequestError("level", level, "sleep levels are 1 (weights to host memory) and 2 (weights "
                                      "dropped, read again from the model source on wake)")
        if level == 2 and self.refusal_2 is not None:
            raise InvalidRequestError("level", level, f"level 2 reads the model source again on wake, but "
                                      f"{self.refusal_2}; use level 1")
        return level

    def sleep(self, level: int, abort: bool = False, drain_timeout_s: float | None = None) -> dict:
        """Wait for the running requests (at most the drain timeout; ``abort``: abort them now, each answered as an
        ordinary abort), hold scheduling, and put every rank to sleep. Blocking."""
        self.check_enabled()
        level = self.check_level(level)
        engine = self.engine
        with self._op:
            if self.level is not None:
                return {**self.view(), "already": True}
            if abort:
                engine.abort_all()
            deadline = time.monotonic() + (self.config.drain_timeout_s if drain_timeout_s is None else drain_timeout_s)
            with engine._lock:
                while engine.scheduler.has_requests() and time.monotonic() < deadline:
                    engine._lock.wait(min(0.05, max(0.0, deadline - time.monotonic())))
                if engine.scheduler.has_requests():
                    busy = engine.scheduler.num_running_reqs + engine.scheduler.num_waiting_reqs
                    raise StageBusyError(f"{busy} request(s) still in flight after the drain timeout; the stage "
                                         "stays awake (POST /sleep?abort=true aborts them)")
                self.gated = True
                self._awake.clear()
            started = time.monotonic()
            try:
                replies = engine.rank_rpc("sleep", (level,))
            except BaseException:
                self._ungate()
                raise
            self.level, self.sleeps_total = level, self.sleeps_total + 1
        log.info("asleep at level %d in %.2f s", level, time.monotonic() - started)
        return {**self.view(), "ranks": replies}

    def wake(self) -> dict:
        """Every rank's weights back, then scheduling resumes. Blocking; awake already: nothing changes."""
        self.check_enabled()
        with self._op:
            if self.level is None:
                return {**self.view(), "already": True}
            started = time.monotonic()
            try:
                replies = self.engine.rank_rpc("wake_up")
            except (RpcError, EngineDeadError) as exc:      # a rank that cannot serve its weights: fail closed
                self.engine.executor.mark_dead(f"wake failed: {exc}")
                raise
            seconds = time.monotonic() - started
            self.level, self.wakes_total, self.last_wake_s = None, self.wakes_total + 1, round(seconds, 3)
            self._ungate()
        for observe in self.on_wake:
            observe(seconds)
        log.info("awake in %.2f s", seconds)
        return {**self.view(), "ranks": replies}

    def _ungate(self) -> None:
        with self.engine._lock:
            self.gated = False
            self._awake.set()
            self.engine._lock.notify_all()

    def admitted(self) -> None:
        """A request was queued (engine.add_request, under its lock): the idle clock restarts; asleep, wake."""
        self.activity += 1
        if self.gated:
            self.wake_soon()

    def wake_soon(self) -> None:
        """Start a wake in the background unless one runs (a request arrived at a sleeping stage)."""
        if self._waker is not None and self._waker.is_alive():
            return
        self._waker = threading.Thread(target=self._wake_logged, name="diffstage-wake", daemon=True)
        self._waker.start()

    def _wake_logged(self) -> None:
        try:
            self.wake()
        except Exception:
            log.exception("wake on demand failed; the engine fails closed")

    def wait_awake(self, timeout: float | None = None) -> bool:
        """Wake if asleep and wait for it: True once awake, False past ``timeout`` (wake_timeout_s by default)."""
        if not self.gated:
            return True
        self.wake_soon()
        return self._awake.wait(self.config.wake_timeout_s if timeout is None else timeout)

    def run_idle_timer(self) -> None:
        """The stage sleeps itself after ``after_idle_s`` without work (a daemon thread; off without it)."""
        idle_s = self.config.after_idle_s
        if not self.config.enabled or idle_s is None:
            return
        threading.Thread(target=self._idle_loop, args=(idle_s,), name="diffstage-idle-sleep", daemon=True).start()

    def _idle_loop(self, idle_s: float) -> None:
        seen, since = self.activity, time.monotonic()
        while not self._stop.wait(min(1.0, idle_s / 4)):
            busy = self.engine.scheduler.has_requests()
            if busy or self.activity != seen or self.gated:
                seen, since = self.activity, time.monotonic()
                continue
            if time.monotonic() - since >= idle_s:
                try:
                    self.sleep(self.config.level)
                except StageBusyError:          # work arrived as it was to sleep: the clock restarts
                    log.debug("idle sleep skipped: work arrived")
                except Exception:
                    log.exception("idle sleep failed")
                    return
                seen, since = self.activity, time.monotonic()

    def close(self) -> None:
        self._stop.set()
