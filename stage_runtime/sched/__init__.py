"""Scheduling policy: request states, FIFO queues, capacity and batch compatibility. No torch, no IPC."""

from stage_runtime.sched.base_scheduler import BaseScheduler
from stage_runtime.sched.request_scheduler import RequestScheduler
from stage_runtime.sched.step_scheduler import StepScheduler

__all__ = ["BaseScheduler", "RequestScheduler", "StepScheduler"]
