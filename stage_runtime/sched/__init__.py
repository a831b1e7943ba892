"""Scheduling policy: request states, FIFO queues, capacity and batch compatibility. No torch, no IPC."""

from stage_runtime.sched.base_scheduler import BaseScheduler, RequestState
from stage_runtime.sched.output import NewRequestData, SchedulerOutput
from stage_runtime.sched.request_scheduler import RequestScheduler

__all__ = ["BaseScheduler", "NewRequestData", "RequestScheduler", "RequestState", "SchedulerOutput"]
