"""What a request's stream receives: pure functions from scheduler state to DiffusionOutput."""

from __future__ import annotations

import time

import numpy as np

from stage_runtime.outputs import DiffusionOutput
from stage_runtime.request import RequestStatus
from stage_runtime.sched.request_state import RequestState

# The engine's outcome counters, by the terminal output's error_type (None = completed; a deadline counts
# as failed here, /metrics tells it apart).
OUTCOME_COUNTERS = {None: "finished_total", "request_aborted": "aborted_total", "request_failed": "failed_total"}


def terminal_output(state: RequestState) -> DiffusionOutput:
    """The one final item of a request: its images, or why it ended without them; with its timings."""
    rid = state.request_id
    arrival, end = state.request.arrival_time, state.finished_at or time.monotonic()
    start = state.scheduled_at or end
    metrics = {"queue_ms": (start - arrival) * 1e3, "exec_ms": (end - start) * 1e3, "e2e_ms": (end - arrival) * 1e3}
    if state.preemptions:
        metrics["preemptions"] = state.preemptions
    if state.result is not None and state.result.compute_ms is not None:
        metrics["compute_ms"] = state.result.compute_ms       # the pipeline call alone, on the rank
    if state.result is not None and state.result.cache is not None:
        metrics.update(state.result.cache)                    # steps_computed, steps_skipped (block cache)
    out = DiffusionOutput(rid, step_index=state.step_index, num_steps=state.request.num_steps, metrics=metrics)
    if state.status == RequestStatus.FINISHED_COMPLETED:
        out.images = state.result.images
    elif state.status == RequestStatus.FINISHED_ABORTED:
        out.error, out.error_type = f"Request {rid} aborted.", "request_aborted"
    else:
        out.error, out.error_type = state.error, state.error_type or "request_failed"
    return out


def progress_output(state: RequestState, preview: np.ndarray | None = None) -> DiffusionOutput:
    """A non-final item: step k of n, with a decoded preview when one was made this step."""
    return DiffusionOutput(state.request_id, finished=False, images=preview, step_index=state.step_index,
                           num_steps=state.request.num_steps)
