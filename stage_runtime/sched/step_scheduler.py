"""StepScheduler: every running request advances exactly one denoising step per tick.

Requests join at tick boundaries when their step key (shape, guidance) matches the running set, and
leave when their last step is done: continuous batching. The scheduler holds progress metadata only
(step_index of num_steps), never tensors; the runner owns the step state.

Preemption (policies that preempt: priority, srpt): at a tick boundary, when a waiting request outranks
the lowest-ranked running one and no slot is free for it, that running request moves to PREEMPTED. Its
step state stays in the runner, so it resumes later from the same step, exactly. A request is preempted
at most ``max_preemptions`` times; after that it runs to its end.
"""

from __future__ import annotations

from stage_runtime.outputs import BatchRunnerOutput
from stage_runtime.request import DiffusionRequest, RequestStatus, StepBatchKey
from stage_runtime.sched.base_scheduler import BaseScheduler
from stage_runtime.sched.request_state import RequestState
from stage_runtime.scheduler_output import SchedulerOutput


class StepScheduler(BaseScheduler):
    mode = "step"
    retires_worker_state = True

    def compatibility_key(self, request: DiffusionRequest) -> StepBatchKey:
        return request.step_key

    def admission_delay(self, now: float | None = None) -> float:
        return 0.0            # ticks are short: a request waits at most one tick to join

    def _preempt(self, out: SchedulerOutput) -> None:
        if not self.policy.preempts or not self._waiting or not self._running:
            return
        tick = self._step_id
        rank = lambda st: self.policy.rank(st, tick)      # noqa: E731
        free = self.max_num_running_reqs - len(self._running)
        for position, cand in enumerate(self.ordered_waiting()):
            compatible = cand.key == self._running_key
            if compatible and free > 0:
                free -= 1                           # it takes a free slot in admission
                continue
            running = [self._states[rid] for rid in self._running]
            movable = [st for st in running if st.preemptions < self.max_preemptions and rank(st) > rank(cand)]
            if compatible and movable:
                self._preempt_one(max(movable, key=rank), out)
                continue                            # its slot goes to cand (free stays 0)
            if not compatible and position == 0 and len(movable) == len(running):
                for st in running:                  # an incompatible first-ranked one needs the whole set
                    self._preempt_one(st, out)
            break                                   # admission stops here (head-of-line), so does preemption

    def _preempt_one(self, state: RequestState, out: SchedulerOutput) -> None:
        self._running.remove(state.request_id)
        state.status, state.preemptions = RequestStatus.PREEMPTED, state.preemptions + 1
        self._waiting.append(state.request_id)
        out.preempted_req_ids.append(state.request_id)
        if not self._running:
            self._running_key = None

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
                state.step_index, state.result, state.phase = out.step_index, out, "denoise"
                if out.finished and out.images is not None:
                    finished += self.finish_requests(rid, RequestStatus.FINISHED_COMPLETED)
                elif out.finished:
                    finished += self.finish_requests(rid, RequestStatus.FINISHED_ERROR,
                                                     f"No output result for request {rid}")
        return finished
