"""DiffusionExecutor: the engine's only way to its workers.

It sends what the scheduler chose and returns what the workers produced; it never admits, reorders
or forwards requests. It owns worker RPC, health, the failure latch and shutdown. Two ways in:

    execute_model(sched_out)     one wave or tick (``sched_out.mode``) → BatchRunnerOutput by request id
    collective_rpc(method, ...)  a declared control RPC (``stage_runtime.control``); others: RpcError

and two hooks out, both called on executor threads: the progress hook (once per denoising step during
a request-mode call; returns the ids the engine wants cancelled, so an abort lands at the next step)
and the output hook (images that arrive after their COMPUTE_DONE, by async output id, once the engine
has claimed them).
"""

from __future__ import annotations

import logging
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from stage_runtime.config import StageConfig
from stage_runtime.control import check_control_rpc
from stage_runtime.errors import ConfigError, EngineDeadError, ModelLoadError
from stage_runtime.outputs import BatchRunnerOutput, OutputHook, ProgressEvent, ProgressHook
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
        self._output_hook: OutputHook | None = None
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

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None, unique_reply_rank: int | None = None) -> Any:
        """Call a declared control RPC on every rank's worker: a list of replies (rank order), or rank
        ``unique_reply_rank``'s reply alone. An undeclared name or a failed rank raises RpcError."""
        return self._collective_rpc(check_control_rpc(method), tuple(args), kwargs or {}, timeout,
                                    unique_reply_rank)

    @abstractmethod
    def _collective_rpc(self, method: str, args: tuple, kwargs: dict, timeout: float | None,
                        unique_reply_rank: int | None) -> Any:
        """The backend's transport for a (checked) control RPC."""

    @abstractmethod
    def _shutdown_workers(self) -> None:
        """Stop every worker and release what they hold."""

    # -- execution -------------------------------------------------------------------------------------
    @abstractmethod
    def execute_model(self, sched_out: SchedulerOutput) -> BatchRunnerOutput:
        """One scheduler output on the workers: a request-mode wave (compatible requests fused into one
        pipeline call) or a step-mode tick (every scheduled request advances one denoising step)."""

    def set_progress_hook(self, hook: ProgressHook | None) -> None:
        self._progress_hook = hook

    def on_progress(self, event: ProgressEvent) -> set[str]:
        """Runner → engine, once per denoising step: returns the ids to stop computing."""
        hook = self._progress_hook
        return set(hook(event)) if hook is not None else set()

    # -- async output (executors whose COMPUTE_DONE comes before the images) ----------------------------
    def set_output_hook(self, hook: OutputHook | None) -> None:
        self._output_hook = hook

    def claim_output(self, async_output_id: str) -> None:
        """The engine wants these images: the output hook gets them (now, if they are already here)."""
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
