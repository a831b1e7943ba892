"""One rank's ``torch.profiler`` session (``POST /start_profile`` … ``/stop_profile``; docs/sleep-and-profile.md).

While it records, the engine's phases on this rank are named ranges in the trace: ``execute step=N`` around each
wave or tick (its request ids in the name), ``encode``, ``denoise step k/n`` and ``decode`` as the runner reports
them (the progress events the engine already gets), and ``checkpoint`` around a step checkpoint. ``stop`` writes
the Chrome-trace JSON ``<dir>/<profile id>-rank<r>.json`` and answers its path.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from stage_runtime.outputs import ProgressEvent, ProgressHook


def phase_name(event: ProgressEvent) -> str:
    ids = ",".join(event.request_ids)
    if event.phase == "denoise":
        return f"denoise step {event.step_index + 1}/{event.num_steps} [{ids}]"
    return f"{event.phase} [{ids}]"


class RankProfiler:
    """At most one session at a time; ``range(name)`` and ``on_progress`` are no-ops while none records."""

    def __init__(self, rank: int, device: torch.device):
        self.rank = rank
        self.device = device
        self.session: profile | None = None
        self.profile_id: str | None = None
        self.folder: Path | None = None
        self.started = 0.0
        self._phase = None                   # the open phase range (record_function), closed by the next

    @property
    def active(self) -> bool:
        return self.session is not None

    def start(self, profile_id: str, folder: str, record_shapes: bool, profile_memory: bool) -> dict:
        if self.session is not None:
            return {"rank": self.rank, "error": f"profile {self.profile_id!r} is already recording"}
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.session = profile(activities=activities, record_shapes=record_shapes, profile_memory=profile_memory,
                               with_stack=False)
        self.session.__enter__()
        self.profile_id, self.started = profile_id, time.monotonic()
        return {"rank": self.rank, "profile_id": profile_id, "pid": os.getpid()}

    def stop(self) -> dict:
        if self.session is None:
            return {"rank": self.rank, "error": "no profile is recording"}
        self._close_phase()
        session, self.session = self.session, None
        session.__exit__(None, None, None)
        path = self.folder / f"{self.profile_id}-rank{self.rank}.json"
        session.export_chrome_trace(str(path))
        return {"rank": self.rank, "profile_id": self.profile_id, "path": str(path), "bytes": path.stat().st_size,
                "seconds": round(time.monotonic() - self.started, 3)}

    @contextlib.contextmanager
    def range(self, name: str):
        if self.session is None:
            yield
            return
        with record_function(name):
            try:
                yield
            finally:
                self._close_phase()          # a phase does not outlive the call it belongs to

    def on_progress(self, event: ProgressEvent) -> None:
        """A phase begins: the previous one ends, this one opens (its range closes at the next, or at the end of
        the execute it runs in)."""
        if self.session is None:
            return
        self._close_phase()
        self._phase = record_function(phase_name(event))
        self._phase.__enter__()

    def _close_phase(self) -> None:
        phase, self._phase = self._phase, None
        if phase is not None:
            phase.__exit__(None, None, None)

    def wrap(self, hook: ProgressHook | None) -> ProgressHook | None:
        """The runner's progress hook, telling this profiler each phase first."""
        if hook is None:
            return None

        def profiled(event: ProgressEvent):
            self.on_progress(event)
            return hook(event)

        return profiled
