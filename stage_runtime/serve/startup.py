"""What the stage is doing while it starts, and how long each phase took: `loading_weights` (the runtime's
imports, the pipeline from disk, the ranks) then `warmup` (one small request). Written by the build thread,
read by the HTTP handlers (`/ready` 503 says the phase; `/v1/stats` carries it, durations included, for the
operator), and the clock of the startup budget (`--startup-timeout`)."""

from __future__ import annotations

import threading
import time
from typing import Any

LOADING_WEIGHTS, WARMUP = "loading_weights", "warmup"
WORDS = {LOADING_WEIGHTS: "loading weights", WARMUP: "warmup", "starting": "starting"}


class StartupProgress:
    def __init__(self, clock=time.monotonic):
        self._clock, self._lock = clock, threading.Lock()
        self.started = self._since = clock()
        self.phase: str | None = "starting"
        self.detail = ""
        self.seconds: dict[str, float] = {}
        self.model_bytes: int | None = None

    def enter(self, phase: str, detail: str = "") -> None:
        with self._lock:
            self._close()
            self.phase, self.detail = phase, detail

    def done(self) -> None:
        with self._lock:
            self._close()
            self.phase, self.detail = None, ""

    def _close(self) -> None:
        now = self._clock()
        if self.phase not in (None, "starting"):
            self.seconds[self.phase] = round(now - self._since, 3)
        self._since = now

    def elapsed(self) -> float:
        return self._clock() - self.started

    def describe(self) -> str:
        """`warmup (1.2 s; loading weights took 3.4 s)`: the phase now and those finished."""
        with self._lock:
            now = self._clock()
            done = "; ".join(f"{WORDS.get(k, k)} took {v:.1f} s" for k, v in self.seconds.items())
            current = f"{WORDS.get(self.phase, self.phase)} for {now - self._since:.1f} s" if self.phase else "ready"
        return current + (f" ({done})" if done else "")

    def view(self) -> dict[str, Any]:
        with self._lock:
            return {"phase": self.phase, "detail": self.detail, "elapsed_s": round(self._clock() - self.started, 3),
                    "phases": dict(self.seconds), "model_bytes": self.model_bytes}
