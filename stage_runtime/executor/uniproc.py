"""UniProcExecutor (``uni``): one worker in the engine process, called on the caller's thread."""

from __future__ import annotations

from typing import Any

from stage_runtime.errors import ConfigError, DiffStageError, EngineClosedError, RpcError
from stage_runtime.executor.abstract import DiffusionExecutor
from stage_runtime.outputs import BatchRunnerOutput
from stage_runtime.scheduler_output import SchedulerOutput
from stage_runtime.worker.worker import DiffusionWorker


class UniProcExecutor(DiffusionExecutor):
    worker: DiffusionWorker | None = None

    def _init_executor(self) -> None:
        world = self.config.parallel.world_size
        if world != 1:
            raise ConfigError(f"executor='uni' runs exactly one rank, but the topology has world_size={world}")
        self.worker = DiffusionWorker(self.config, rank=0, progress_hook=self.on_progress)
        try:
            self.worker.init_device()
            self.worker.load_model()
        except BaseException:
            self.worker.shutdown()
            self.worker = None
            raise

    def _collective_rpc(self, method: str, args: tuple, kwargs: dict, timeout: float | None,
                        unique_reply_rank: int | None) -> Any:
        # The timeout is accepted for interface parity; an in-process call cannot be abandoned safely.
        worker = self._live_worker()
        try:
            reply = worker.control_rpc(method, args, kwargs)
        except DiffStageError:
            raise
        except Exception as exc:
            raise RpcError(f"RPC {method!r} failed on worker rank 0: {type(exc).__name__}: {exc}") from exc
        return reply if unique_reply_rank is not None else [reply]

    def execute_model(self, sched_out: SchedulerOutput) -> BatchRunnerOutput:
        return self._live_worker().execute_model(sched_out)

    def _live_worker(self) -> DiffusionWorker:
        if self._closed or self.worker is None:
            raise EngineClosedError("DiffusionExecutor is closed.")
        self.check_health()
        return self.worker

    def _shutdown_workers(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
