"""What a request's stream receives: pure functions from scheduler state to DiffusionOutput."""

from __future__ import annotations

import time

import numpy as np

from stage_runtime.errors import RequestAbortedError, RequestFailedError, outcome_of
from stage_runtime.outputs import DiffusionOutput
from stage_runtime.request import RequestStatus
from stage_runtime.sched.request_state import RequestState

# The engine's three counters (/v1/stats), by the request's outcome (errors.outcome_of): every outcome but
# completed and aborted counts as failed here (a deadline too; /metrics tells them apart).
_COUNTERS = {"completed": "finished_total", "aborted": "aborted_total"}


def outcome_counter(error_type: str | None) -> str:
    """The engine counter a terminal output with ``error_type`` (None: it completed) adds to."""
    return _COUNTERS.get(outcome_of(error_type), "failed_total")


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
        out.images, out.audio = state.result.images, state.result.audio
    elif state.status == RequestStatus.FINISHED_ABORTED:
        out.error, out.error_type = f"Request {rid} aborted.", RequestAbortedError.error_type
    else:
        out.error, out.error_type = state.error, state.error_type or RequestFailedError.error_type
    return out


def progress_output(state: RequestState, preview: np.ndarray | None = None) -> DiffusionOutput:
    """A non-final item: the phase, step k of n, with a decoded preview when one was made this step."""
    return DiffusionOutput(state.request_id, finished=False, images=preview, step_index=state.step_index,
                           num_steps=state.request.num_steps, phase=state.phase)
