"""DiffusionExecutor: the engine's only way to its workers.

It sends what the scheduler chose and returns what the workers produced; it never admits, reorders
or forwards requests. It owns worker RPC, health, the failure latch and shutdown. During an execute
call it forwards the runner's per-step progress to the engine's progress hook and returns the ids the
engine wants cancelled (aborts reach a running pipeline call at the next denoising step).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from stage_runtime.config import StageConfig
from stage_runtime.errors import ConfigError, EngineDeadError, ModelLoadError
from stage_runtime.outputs import BatchRunnerOutput, ProgressEvent, ProgressHook
from stage_runtime.plugins import import_object
from stage_runtime.scheduler_output import SchedulerOutput

log = logging.getLogger(__name__)

FailureCallback = Callable[[str], None]

BUILTIN_EXECUTORS = {
    "uni": "stage_runtime.executor.uniproc:UniProcExecutor",
    "mp": "stage_runtime.executor.multiproc:MultiprocExecutor",
}


class DiffusionExecutor(ABC):
    def __init__(self, config: StageConfig):
        self.config = config
        self._failure_callbacks: list[FailureCallback] = []
        self._progress_hook: ProgressHook | None = None
        self._dead_reason: str | None = None
        self._latch = threading.Lock()
        self._closed = False
        self._init_executor()

    @staticmethod
    def get_class(config: StageConfig) -> type["DiffusionExecutor"]:
        """``uni`` / ``mp`` or a ``package.module:Class`` subclass of DiffusionExecutor."""
        name = config.resolved_executor
        try:
            cls = import_object(BUILTIN_EXECUTORS.get(name, name))
        except ModelLoadError as exc:
            raise ConfigError(f"executor={name!r} is not available: {exc}") from None
        if not (isinstance(cls, type) and issubclass(cls, DiffusionExecutor)):
            raise ConfigError(f"executor={name!r} is not a DiffusionExecutor subclass")
        return cls

    # -- backend contract ------------------------------------------------------------------------------
    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers and load the model on every rank."""

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None, unique_reply_rank: int | None = None) -> Any:
        """Call ``method`` on every rank's worker: a list of replies, or one reply when a rank is named."""

    @abstractmethod
    def _shutdown_workers(self) -> None:
        """Stop every worker and release what they hold."""

    # -- execution -------------------------------------------------------------------------------------
    def execute_batch(self, sched_out: SchedulerOutput) -> BatchRunnerOutput:
        """Request mode: one wave of whole requests (fused into one pipeline call when compatible)."""
        return self.collective_rpc("execute_model_batch", args=(sched_out,), unique_reply_rank=0)

    def execute_step(self, sched_out: SchedulerOutput) -> BatchRunnerOutput:
        """Step mode: advance every scheduled request one denoising step."""
        return self.collective_rpc("execute_step", args=(sched_out,), unique_reply_rank=0)

    def set_progress_hook(self, hook: ProgressHook | None) -> None:
        self._progress_hook = hook

    def on_progress(self, event: ProgressEvent) -> set[str]:
        """Runner → engine, once per denoising step: returns the ids to stop computing."""
        hook = self._progress_hook
        return set(hook(event)) if hook is not None else set()

    # -- async output (executors whose COMPUTE_DONE comes before the images) ----------------------------
    def wait_output_ready(self, async_output_id: str) -> concurrent.futures.Future:
        raise NotImplementedError(f"{type(self).__name__} returns no async outputs")

    def drop_output(self, async_output_id: str) -> None:  # noqa: B027 - optional hook, a no-op by default
        """The engine no longer wants these images (aborted, or the client is gone)."""

    # -- health and failure ----------------------------------------------------------------------------
    def workers(self) -> list[dict[str, Any]]:
        """One entry per rank: ``{"rank", "pid", "alive"}``."""
        return [{"rank": 0, "pid": os.getpid(), "alive": not self.is_dead}]

    @property
    def is_dead(self) -> bool:
        return self._dead_reason is not None

    def check_health(self) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        if self._closed:
            raise EngineDeadError("DiffusionExecutor is closed.")

    def register_failure_callback(self, callback: FailureCallback) -> None:
        self._failure_callbacks.append(callback)
        if self._dead_reason is not None:
            callback(self._dead_reason)

    def mark_dead(self, reason: str) -> None:
        """Latch dead once (fail closed): fire every failure callback exactly once."""
        with self._latch:
            if self._dead_reason is not None:
                return
            self._dead_reason = reason
        log.error("executor failed: %s", reason)
        for callback in self._failure_callbacks:
            callback(reason)

    def shutdown(self) -> None:
        """Idempotent."""
        with self._latch:
            if self._closed:
                return
            self._closed = True
        self._shutdown_workers()
