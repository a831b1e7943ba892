"""RequestScheduler: whole requests per wave; compatible requests fuse into one pipeline call."""

from __future__ import annotations

import time

from stage_runtime.config import SchedulerConfig
from stage_runtime.outputs import BatchRunnerOutput
from stage_runtime.request import DiffusionRequest, RequestBatchKey, RequestStatus
from stage_runtime.sched.base_scheduler import BaseScheduler
from stage_runtime.scheduler_output import SchedulerOutput

STABLE_WINDOW_MAX_S = 0.05


class RequestScheduler(BaseScheduler):
    mode = "request"

    def __init__(self, config: SchedulerConfig, capacity: int | None = None):
        super().__init__(config, capacity)
        self.batch_wait_s = config.request_batch_max_wait_ms / 1000.0
        self._wait_started_at: float | None = None
        self._last_add_at = 0.0

    def compatibility_key(self, request: DiffusionRequest) -> RequestBatchKey:
        return request.batch_key

    def add_request(self, request: DiffusionRequest) -> str:
        rid = super().add_request(request)
        self._last_add_at = time.monotonic()
        if self._wait_started_at is None:
            self._wait_started_at = self._last_add_at
        return rid

    def admission_delay(self, now: float | None = None) -> float:
        """Seconds to hold the next wave so more compatible requests can join it (0 = schedule now).

        Waits only with a configured wait, capacity > 1 and nothing running; ends when the queue fills
        capacity, when no request arrived for a short stable window, or at the deadline.
        """
        if (self.batch_wait_s <= 0 or self.max_num_running_reqs <= 1 or self.num_running_reqs
                or not self._waiting or len(self._waiting) >= self.max_num_running_reqs
                or self._wait_started_at is None):
            return 0.0
        now = time.monotonic() if now is None else now
        stable = min(STABLE_WINDOW_MAX_S, self.batch_wait_s / 5)
        until = min(self._wait_started_at + self.batch_wait_s, self._last_add_at + stable)
        return max(0.0, until - now)

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        if out.scheduled_new_reqs:
            self._wait_started_at = self._last_add_at if self._waiting else None
        return out

    def update_from_output(self, sched_out: SchedulerOutput, runner_out: BatchRunnerOutput) -> list[str]:
        finished = []
        for rid in sched_out.scheduled_request_ids:
            state = self.get_request_state(rid)
            if state is None or state.status != RequestStatus.RUNNING:
                continue          # aborted (and already reported) while the wave ran
            out = runner_out.get(rid)
            if out is None:
                status, error = RequestStatus.FINISHED_ERROR, f"No output result for request {rid}"
            elif out.aborted:
                status, error = RequestStatus.FINISHED_ABORTED, None
            elif out.error is not None:
                status, error = RequestStatus.FINISHED_ERROR, out.error
            elif out.images is None and out.async_output_id is None:
                status, error = RequestStatus.FINISHED_ERROR, f"No output result for request {rid}"
            else:
                status, error = RequestStatus.FINISHED_COMPLETED, None
            state.result = out
            if out is not None and out.step_index is not None:
                state.step_index = out.step_index
            finished += self.finish_requests(rid, status, error)
        return finished
