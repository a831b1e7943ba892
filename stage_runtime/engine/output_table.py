"""OutputTable: every admitted request's stream, and what reaches it — progress, late images, the end.

    open(rid)            admission: the request's RequestStream
    progress(...)        non-final items for requests that asked (stream, previews, streaming_output)
    finalize(states)     each terminal request delivered exactly once, its scheduler state already gone;
                         request-mode images that come later (async output) are claimed from the executor
    on_output_ready      the executor's output hook: late images (or why they are lost) → delivery
    abort(rids)          computed but images not here yet: drop them, deliver the abort
    fail_all(...)        engine death or close: every open stream gets the error

Every method but ``on_output_ready`` runs with the engine's lock held; that one takes it (the lock is
re-entrant: a claim whose images already arrived delivers on the caller's thread).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable

import numpy as np

from stage_runtime.engine.delivery import outcome_counter, progress_output, terminal_output
from stage_runtime.engine.stream import RequestStream
from stage_runtime.errors import RequestAbortedError, RequestFailedError
from stage_runtime.executor.abstract import DiffusionExecutor
from stage_runtime.model_info import ModelInfo
from stage_runtime.outputs import DiffusionOutput
from stage_runtime.request import DiffusionRequest, EditInput, SamplingParams
from stage_runtime.sched.request_state import RequestState

WARMUP_PREFIX = "warmup-"


def warmup_request(info: ModelInfo) -> DiffusionRequest:
    """The 2-step request a stage runs before it reports ready (left out of the outcome counters); a video
    family's is its shortest video (one frame for Wan's 4k+1) at its default size, from a grey picture when it
    makes videos from images; an edit of a grey picture of that size for a family that only edits."""
    frames = None if info.frame_rule is None else info.frame_rule[1] % info.frame_rule[0] or info.frame_rule[0]
    grey = np.full((info.default_height, info.default_width, 3), 128, dtype=np.uint8)
    return DiffusionRequest(f"{WARMUP_PREFIX}{uuid.uuid4().hex[:8]}", "warmup",
                            SamplingParams(num_inference_steps=2, seed=0, num_frames=frames), video=info.video,
                            reference=grey if info.reference == "required" else None,
                            edit=EditInput(grey) if info.edits_only else None)


class OutputTable:
    def __init__(self, lock: threading.Condition, executor: DiffusionExecutor, streaming_output: bool):
        self._lock = lock
        self._executor = executor
        self._streaming_output = streaming_output
        self.streams: dict[str, RequestStream] = {}
        self._late: dict[str, str] = {}                  # request id → async output id (images not here yet)
        self._pending: dict[str, DiffusionOutput] = {}   # async output id → the output waiting for its images
        self.counters = {"finished_total": 0, "aborted_total": 0, "failed_total": 0}
        self.on_final: Callable[[DiffusionOutput], None] | None = None   # every final output (the result cache)

    def open(self, request_id: str) -> RequestStream:
        stream = self.streams[request_id] = RequestStream(request_id)
        return stream

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.streams

    def awaits_images(self, request_id: str) -> bool:
        """Computed (the scheduler is done with it) but its images are still on their way."""
        return request_id in self._late

    def user_request_ids(self) -> list[str]:
        return [rid for rid in self.streams if not rid.startswith(WARMUP_PREFIX)]

    # -- delivery ----------------------------------------------------------------------------------------
    def finalize(self, states: list[RequestState]) -> None:
        """Deliver each terminal request once. A request whose images come later keeps only its stream
        and its async output id until they arrive, an abort, or close."""
        for state in states:
            output = terminal_output(state)
            async_id = state.result.async_output_id if state.result is not None and output.error is None else None
            if async_id is None:
                self._deliver(output)
                continue
            self._late[output.request_id], self._pending[async_id] = async_id, output
            self._executor.claim_output(async_id)

    def on_output_ready(self, async_id: str, images: np.ndarray | None, error: str | None) -> None:
        with self._lock:
            output = self._pending.pop(async_id, None)
            if output is None:
                return                              # dropped: the abort already delivered
            del self._late[output.request_id]
            if error is None:
                output.images = images
            else:
                output.error, output.error_type = f"Output lost: {error}", RequestFailedError.error_type
                output.audio = None
            self._deliver(output)

    def abort(self, request_ids: list[str]) -> None:
        """Requests already computed whose images are not here yet: drop them and deliver the abort."""
        for rid in request_ids:
            async_id = self._late.pop(rid, None)
            if async_id is not None:
                del self._pending[async_id]
                self._executor.drop_output(async_id)
                self._deliver(DiffusionOutput(rid, error=f"Request {rid} aborted.",
                                              error_type=RequestAbortedError.error_type))

    def progress(self, states: list[RequestState], previews: dict[str, np.ndarray | None] | None = None) -> None:
        """Non-final items for running requests that asked for progress (``stream``) or previews."""
        for state in states:
            stream = self.streams.get(state.request_id)
            if stream is None or state.status.finished or not self._wants_progress(state):
                continue
            stream.put(progress_output(state, (previews or {}).get(state.request_id)))

    def _wants_progress(self, state: RequestState) -> bool:
        s = state.request.sampling
        return s.stream or s.preview_every is not None or self._streaming_output

    def _deliver(self, output: DiffusionOutput) -> None:
        rid = output.request_id
        if not rid.startswith(WARMUP_PREFIX):
            self.counters[outcome_counter(output.error_type)] += 1
        stream = self.streams.pop(rid, None)
        if self.on_final is not None:
            self.on_final(output)
        if stream is not None:
            stream.put(output)

    def fail_all(self, message: str, error_type: str) -> None:
        """Every open stream ends with ``message`` (engine death or close); late images are forgotten."""
        streams, self.streams = self.streams, {}
        self._late.clear()
        self._pending.clear()
        for rid, stream in streams.items():
            output = DiffusionOutput(rid, error=message, error_type=error_type)
            if self.on_final is not None:
                self.on_final(output)
            stream.put(output)
