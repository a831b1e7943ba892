"""Scheduling policy: request states, FIFO queues, capacity and batch compatibility. No torch, no IPC."""

from stage_runtime.sched.base_scheduler import BaseScheduler, RequestState
from stage_runtime.scheduler_output import NewRequestData, SchedulerOutput
from stage_runtime.sched.request_scheduler import RequestScheduler
from stage_runtime.sched.step_scheduler import StepScheduler

__all__ = ["BaseScheduler", "NewRequestData", "RequestScheduler", "RequestState", "SchedulerOutput", "StepScheduler"]
