"""The replica's outstanding work and its completion rate, in one unit: pixel-steps (output pixels × frames ×
outputs, per denoising step) — the unit of ``limits.max_request_cost``, so a 1024² 50-step request weighs what it
costs, about 60× a 256² 20-step one. What the fleet routes and scales on (docs/http-api.md, docs/operator.md):

- ``outstanding``: Σ over the requests in flight (waiting, running, preempted) of the steps they have left ×
  their pixel-steps per step;
- ``completed_total``: the steps run so far × pixel-steps per step, over every request that ran (finished,
  aborted or failed: the work was done) and the steps the live ones have run: a counter that moves with each
  step, never only when a long request ends;
- ``rate``: pixel-steps completed per second over the last ``window`` seconds of reads (the operator's probe
  and a Prometheus scrape read it every few seconds; 0 until two reads are that far apart).

The engine calls ``finished`` under its lock as states leave the scheduler and ``snapshot`` under its lock with
the live states; the meter holds no request.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable
from typing import Any

from stage_runtime.request import DiffusionRequest, RequestStatus
from stage_runtime.sched.request_state import RequestState

RATE_WINDOW_S = 60.0


def step_cost(request: DiffusionRequest) -> int:
    """Pixel-steps of one denoising step of this request: height × width × frames × outputs."""
    s = request.sampling
    return (s.height or 0) * (s.width or 0) * (s.num_frames or 1) * s.num_outputs


class CostMeter:
    def __init__(self, window: float = RATE_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window, self._clock = window, clock
        self._done = 0                      # pixel-steps of the requests that left the scheduler
        self._reads: collections.deque[tuple[float, int]] = collections.deque()

    def finished(self, states: Iterable[RequestState]) -> None:
        """Terminal states leaving the scheduler: the steps each ran count as done work."""
        self._done += sum(state.step_index * step_cost(state.request) for state in states)

    def snapshot(self, live: Iterable[RequestState]) -> dict[str, Any]:
        """``outstanding``, ``completed_total``, ``rate`` (pixel-steps per second) and the adapters the waiting
        requests name (``waiting_loras``, sorted), for the live states."""
        outstanding, running_done, waiting_loras = 0, 0, set()
        for state in live:
            unit = step_cost(state.request)
            outstanding += max(state.request.num_steps - state.step_index, 0) * unit
            running_done += state.step_index * unit
            if state.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                waiting_loras.update(ref.name for ref in state.request.sampling.loras)
        completed = self._done + running_done
        return {"outstanding": outstanding, "completed_total": completed, "rate": self._rate(completed),
                "waiting_loras": sorted(waiting_loras)}

    def _rate(self, completed: int) -> float:
        now = self._clock()
        reads = self._reads
        reads.append((now, completed))
        while len(reads) > 2 and reads[1][0] <= now - self.window:    # keep one read from before the window
            reads.popleft()
        (start, first), span = reads[0], now - reads[0][0]
        return (completed - first) / span if span > 0 else 0.0
