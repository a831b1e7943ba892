"""StepScheduler: every running request advances exactly one denoising step per tick.

Requests join at tick boundaries when their step key (shape, guidance) matches the running set, and
leave when their last step is done: continuous batching. The scheduler holds progress metadata only
(step_index of num_steps), never tensors; the runner owns the step state.
"""

from __future__ import annotations

from stage_runtime.outputs import BatchRunnerOutput
from stage_runtime.request import DiffusionRequest, RequestStatus, StepBatchKey
from stage_runtime.sched.base_scheduler import BaseScheduler
from stage_runtime.scheduler_output import SchedulerOutput


class StepScheduler(BaseScheduler):
    mode = "step"
    retires_worker_state = True

    def compatibility_key(self, request: DiffusionRequest) -> StepBatchKey:
        return request.step_key

    def admission_delay(self, now: float | None = None) -> float:
        return 0.0            # ticks are short: a request waits at most one tick to join

    def update_from_output(self, sched_out: SchedulerOutput, runner_out: BatchRunnerOutput) -> list[str]:
        finished = []
        for rid in sched_out.scheduled_request_ids:
            state = self.get_request_state(rid)
            if state is None or state.status != RequestStatus.RUNNING:
                continue      # aborted while the tick ran
            out = runner_out.get(rid)
            if out is None:
                finished += self.finish_requests(rid, RequestStatus.FINISHED_ERROR, f"No output for request {rid}")
            elif out.aborted:
                finished += self.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            elif out.error is not None:
                finished += self.finish_requests(rid, RequestStatus.FINISHED_ERROR, out.error)
            elif out.step_index is None:
                finished += self.finish_requests(rid, RequestStatus.FINISHED_ERROR,
                                                 f"Missing step_index in output for request {rid}")
            else:
                state.step_index, state.result = out.step_index, out
                if out.finished and out.images is not None:
                    finished += self.finish_requests(rid, RequestStatus.FINISHED_COMPLETED)
                elif out.finished:
                    finished += self.finish_requests(rid, RequestStatus.FINISHED_ERROR,
                                                     f"No output result for request {rid}")
        return finished
