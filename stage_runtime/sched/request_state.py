"""RequestState: what the scheduler holds for one admitted request, from admission until the engine pops it.

The policies rank it, the schedulers move it through ``RequestStatus``, and the engine turns it into the
request's terminal output (``engine.delivery``). Plain data: it imports nothing of the scheduler.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from stage_runtime.outputs import RunnerOutput
from stage_runtime.request import DiffusionRequest, RequestStatus


@dataclass
class RequestState:
    request: DiffusionRequest
    key: Hashable
    status: RequestStatus = RequestStatus.WAITING
    error: str | None = None
    error_type: str | None = None       # FINISHED_ERROR's kind when it is not a plain failure
    result: RunnerOutput | None = None
    step_index: int = 0
    phase: str | None = None            # running: outputs.PHASES ("encode", "denoise", "decode"); None: not started
    queued_at: float = 0.0
    scheduled_at: float | None = None
    finished_at: float | None = None
    seq: int = 0                        # admission order (the policies' tie-break)
    admitted_tick: int = 0              # the scheduler tick at admission (aging)
    deadline: float | None = None       # monotonic; arrival + timeout_s
    preemptions: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def snapshot(self) -> dict[str, Any]:
        """One row of ``GET /v1/requests``: state, step progress, priority, preemptions, block-cache counts."""
        return {"request_id": self.request_id, "state": self.status.name.lower(), "step": self.step_index,
                "phase": self.phase, "num_steps": self.request.num_steps, "priority": self.request.sampling.priority,
                "preempted": self.status == RequestStatus.PREEMPTED, "preemptions": self.preemptions,
                **((self.result and self.result.cache) or {})}   # steps_computed, steps_skipped (block cache)
