"""BaseScheduler: request states, the waiting queue, the running set, capacity, deadlines and terminal transitions.

The waiting queue is served in the order of the scheduling policy (``sched.policy``: fcfs, priority,
srpt). Subclasses decide the compatibility key, how an execution result updates a request, and whether
a running request may be preempted (``RequestScheduler``: whole requests per wave, never;
``StepScheduler``: one denoising step per tick, at tick boundaries).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Hashable, Iterable
from typing import ClassVar

from stage_runtime.config import ExecutionMode, SchedulerConfig
from stage_runtime.errors import DeadlineExceededError, DuplicateRequestError, QueueFullError
from stage_runtime.outputs import BatchRunnerOutput
from stage_runtime.request import DiffusionRequest, RequestStatus
from stage_runtime.scheduler_output import NewRequestData, SchedulerOutput
from stage_runtime.sched.policy import make_policy
from stage_runtime.sched.request_state import RequestState


class BaseScheduler(ABC):
    mode: ClassVar[ExecutionMode]
    # Step mode keeps per-request state on the workers: an empty tick must still tell them what finished.
    retires_worker_state: ClassVar[bool] = False

    def __init__(self, config: SchedulerConfig, capacity: int | None = None):
        # capacity: the engine's override (a DLO wave: max_num_seqs on each data-parallel rank)
        self.max_num_running_reqs = max(1, capacity or config.max_num_seqs)
        self.max_waiting = config.max_waiting
        self.policy = make_policy(config)
        self.max_preemptions = config.max_preemptions
        self.default_timeout_s = config.default_timeout_s
        self._seq = 0
        self._states: dict[str, RequestState] = {}      # every request not yet popped by the engine
        self._waiting: deque[str] = deque()
        self._running: list[str] = []
        self._running_key: Hashable | None = None
        self._finished_since_schedule: set[str] = set()
        self._step_id = 0

    # -- policy hooks ---------------------------------------------------------------------------------
    @abstractmethod
    def compatibility_key(self, request: DiffusionRequest) -> Hashable:
        """Requests run in the same wave only when their keys are equal."""

    @abstractmethod
    def update_from_output(self, sched_out: SchedulerOutput, runner_out: BatchRunnerOutput) -> list[str]:
        """Apply one execution result; return the ids that became terminal."""

    # -- admission --------------------------------------------------------------------------------------
    def add_request(self, request: DiffusionRequest) -> str:
        rid = request.request_id
        if rid in self._states:
            raise DuplicateRequestError(f"request_id={rid!r} is already in flight")
        if len(self._waiting) >= self.max_waiting:
            raise QueueFullError(f"waiting queue is full ({len(self._waiting)} of max_waiting={self.max_waiting})")
        timeout = request.sampling.timeout_s or self.default_timeout_s
        self._seq += 1
        self._states[rid] = RequestState(request, self.compatibility_key(request), queued_at=time.monotonic(),
                                         seq=self._seq, admitted_tick=self._step_id,
                                         deadline=None if timeout is None else request.arrival_time + timeout)
        self._waiting.append(rid)
        return rid

    def schedule(self) -> SchedulerOutput:
        # NOTE: the waiting queue in policy order (fcfs: admission order). Running requests go out as cached
        # ids. First the subclass may preempt running requests that a waiting one outranks (step mode).
        # Then waiting requests are admitted in rank order while capacity remains and their key equals the
        # running key (the first admitted request defines it); a preempted one resumes as a cached id. The
        # first incompatible one stops admission: head-of-line blocking is deliberate (no request can
        # starve behind later compatible ones).
        self._step_id += 1
        out = SchedulerOutput(step_id=self._step_id, mode=self.mode)
        self._preempt(out)
        out.scheduled_cached_req_ids = list(self._running)
        now = time.monotonic()
        for state in self.ordered_waiting():
            if len(self._running) >= self.max_num_running_reqs:
                break
            if self._running and state.key != self._running_key:
                break
            self._waiting.remove(state.request_id)
            if not self._running:
                self._running_key = state.key
            if state.status == RequestStatus.PREEMPTED:
                out.scheduled_cached_req_ids.append(state.request_id)
                out.resumed_req_ids.append(state.request_id)
            else:
                state.scheduled_at = now
                out.scheduled_new_reqs.append(NewRequestData(state.request_id, state.request))
            state.status = RequestStatus.RUNNING
            self._running.append(state.request_id)
        out.finished_req_ids, self._finished_since_schedule = self._finished_since_schedule, set()
        out.num_waiting_reqs = len(self._waiting)
        return out

    def ordered_waiting(self) -> list[RequestState]:
        """Waiting and preempted requests in the order the policy serves them."""
        return self.policy.order([self._states[rid] for rid in self._waiting], self._step_id)

    def _preempt(self, out: SchedulerOutput) -> None:
        """Step mode overrides it: move outranked running requests to PREEMPTED (``out.preempted_req_ids``)."""

    # -- deadlines --------------------------------------------------------------------------------------
    def expire_deadlines(self, now: float | None = None) -> list[str]:
        """End every unfinished request whose deadline has passed (queued: unrun; running: at this boundary)."""
        now = time.monotonic() if now is None else now
        expired = [st for st in self._states.values()
                   if st.deadline is not None and st.deadline <= now and not st.status.finished]
        done = []
        for st in expired:
            timeout = st.deadline - st.request.arrival_time
            done += self.finish_requests(st.request_id, RequestStatus.FINISHED_ERROR,
                                         f"Request {st.request_id} exceeded its deadline (timeout_s={timeout:g}) "
                                         f"at step {st.step_index} of {st.request.num_steps}",
                                         DeadlineExceededError.error_type)
        return done

    # -- terminal transitions ---------------------------------------------------------------------------
    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus,
                        error: str | None = None, error_type: str | None = None) -> list[str]:
        """Move known, unfinished requests to a terminal status; unknown or finished ids are ignored."""
        assert status.finished, status
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        done = []
        for rid in ids:
            state = self._states.get(rid)
            if state is None or state.status.finished:
                continue
            if state.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                self._waiting.remove(rid)
            else:
                self._running.remove(rid)
            state.status, state.finished_at = status, time.monotonic()
            if status == RequestStatus.FINISHED_ERROR:
                state.error, state.error_type = error or "request failed", error_type
            self._finished_since_schedule.add(rid)
            done.append(rid)
        if not self._running:
            self._running_key = None
        return done

    def pop_request_state(self, request_id: str) -> RequestState:
        """Remove a terminal request's state for good (the engine calls it once, when it delivers)."""
        state = self._states[request_id]
        assert state.status.finished, f"{request_id} is {state.status.name}"
        return self._states.pop(request_id)

    def update_progress(self, request_ids: Iterable[str], step_index: int, phase: str = "denoise") -> None:
        for rid in request_ids:
            state = self._states.get(rid)
            if state is not None and state.status == RequestStatus.RUNNING:
                state.step_index, state.phase = step_index, phase

    # -- queries ----------------------------------------------------------------------------------------
    def get_request_state(self, request_id: str) -> RequestState | None:
        return self._states.get(request_id)

    def live_states(self, request_ids: Iterable[str]) -> list[RequestState]:
        """The states of those requests the scheduler still holds, in the given order."""
        return [st for rid in request_ids if (st := self._states.get(rid)) is not None]

    def has_requests(self) -> bool:
        return bool(self._waiting or self._running)

    def has_unreported_finished(self) -> bool:
        """Terminal requests whose worker state must still be retired (a reason to run an empty tick)."""
        return self.retires_worker_state and bool(self._finished_since_schedule)

    def should_execute(self, out: SchedulerOutput) -> bool:
        """Whether ``out`` goes to the workers: something is scheduled, or worker state must be retired."""
        return not out.is_empty or (self.retires_worker_state and bool(out.finished_req_ids))

    @property
    def num_waiting_reqs(self) -> int:
        return len(self._waiting)

    @property
    def num_running_reqs(self) -> int:
        return len(self._running)

    @property
    def num_states(self) -> int:
        return len(self._states)

    def request_ids(self) -> list[str]:
        return list(self._states)

    def close(self) -> None:
        self._states.clear()
        self._waiting.clear()
        self._running.clear()
        self._finished_since_schedule.clear()
        self._running_key = None
