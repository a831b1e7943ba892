"""SchedulerOutput: the only boundary between scheduling policy and execution.

A request's full payload crosses once (``scheduled_new_reqs``); afterwards only its id does
(``scheduled_cached_req_ids``). ``finished_req_ids`` tells workers which per-request state to drop. Step mode only:
``preempted_req_ids`` left the running set at this boundary (the runner keeps their step state, maybe on
the host); ``resumed_req_ids`` come back (a subset of the cached ids; the runner restores their state).
``mode`` says how the runner executes it: ``request`` (whole requests, one pipeline call per wave) or
``step`` (one denoising step of every scheduled request). No tensors, no callables.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stage_runtime.config import ExecutionMode
from stage_runtime.request import DiffusionRequest


@dataclass(frozen=True)
class NewRequestData:
    request_id: str
    request: DiffusionRequest          # resolved at admission: every sampling field is concrete


@dataclass
class SchedulerOutput:
    step_id: int                                                       # global wave / tick counter
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_req_ids: list[str] = field(default_factory=list)  # already sent, still running
    finished_req_ids: set[str] = field(default_factory=set)            # terminal since the last schedule()
    preempted_req_ids: list[str] = field(default_factory=list)         # paused now; state kept by the runner
    resumed_req_ids: list[str] = field(default_factory=list)           # ⊆ cached ids: back from preemption
    num_waiting_reqs: int = 0
    mode: ExecutionMode = "request"

    @property
    def scheduled_request_ids(self) -> list[str]:
        return [r.request_id for r in self.scheduled_new_reqs] + list(self.scheduled_cached_req_ids)

    @property
    def num_scheduled_reqs(self) -> int:
        return len(self.scheduled_new_reqs) + len(self.scheduled_cached_req_ids)

    @property
    def is_empty(self) -> bool:
        return self.num_scheduled_reqs == 0
