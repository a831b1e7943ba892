"""Execute observers: metrics hooks called on the engine thread after every executed wave or tick."""

from __future__ import annotations

import logging
from collections.abc import Callable

from stage_runtime.outputs import BatchRunnerOutput
from stage_runtime.scheduler_output import SchedulerOutput

log = logging.getLogger(__name__)

# (batch_size, seconds, denoising_steps): request mode counts the steps the wave ran, step mode one.
ExecuteObserver = Callable[[int, float, int], None]


class ExecuteObservers:
    def __init__(self) -> None:
        self._observers: list[ExecuteObserver] = []

    def add(self, observer: ExecuteObserver) -> None:
        """``observer(batch_size, seconds, steps)`` after every executed wave or tick; keep it cheap."""
        self._observers.append(observer)

    def notify(self, sched_out: SchedulerOutput, seconds: float, runner_out: BatchRunnerOutput) -> None:
        batch_size = sched_out.num_scheduled_reqs
        if not batch_size or not self._observers:
            return
        if sched_out.mode == "step":
            steps = 1
        else:
            steps = max((o.step_index or 0 for o in runner_out.outputs.values()), default=0) or 1
        for observer in self._observers:
            try:
                observer(batch_size, seconds, steps)
            except Exception:
                log.exception("execute observer %r failed", observer)
