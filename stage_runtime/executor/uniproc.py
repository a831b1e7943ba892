"""UniProcExecutor (``uni``): one worker in the engine process, called on the caller's thread."""

from __future__ import annotations

from typing import Any

from stage_runtime.errors import ConfigError, EngineClosedError
from stage_runtime.executor.abstract import DiffusionExecutor
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

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None, unique_reply_rank: int | None = None) -> Any:
        # The timeout is accepted for interface parity; an in-process call cannot be abandoned safely.
        if self._closed or self.worker is None:
            raise EngineClosedError("DiffusionExecutor is closed.")
        self.check_health()
        reply = getattr(self.worker, method)(*args, **(kwargs or {}))
        return reply if unique_reply_rank is not None else [reply]

    def _shutdown_workers(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
