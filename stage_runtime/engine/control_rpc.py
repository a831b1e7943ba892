"""Control RPCs through the engine (``stage_runtime.control``): ordered with the waves on the busy-loop thread, or
direct before the loop starts. The RPCs whose state the engine keeps go through their owner instead of straight to
the ranks: LoRA (engine.lora_table), sleep and wake (engine.sleep_control: scheduling is held around them), the
profiler (engine.profiler_control: one profile at a time). A part of
:class:`~stage_runtime.engine.engine.DiffusionEngine` (its mixin)."""

from __future__ import annotations

from typing import Any

from stage_runtime.engine.lora_table import LORA_RPCS
from stage_runtime.errors import StageUnavailableError

OWNED_RPCS = {
    "sleep": lambda engine, level=1, abort=False, drain_timeout_s=None: engine.sleep.sleep(level, abort,
                                                                                           drain_timeout_s),
    "wake_up": lambda engine: engine.sleep.wake(),
    "start_profile": lambda engine: engine.profiler.start(),
    "stop_profile": lambda engine: engine.profiler.stop(),
}


class EngineControlRpc:
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None, unique_reply_rank: int | None = None,
                       abort_with: tuple[str, ...] = ()) -> Any:
        """A declared control RPC (``stage_runtime.control``) on the busy-loop thread, ordered with waves;
        direct before the loop starts. An undeclared name, a failed rank or a timeout: RpcError. The LoRA
        RPCs go through the engine's adapter table (engine.lora_table), which then tells every rank.
        ``abort_with``: requests aborted at the tick boundary the RPC runs at (before their runner state is
        freed), so no step runs between the two: a job's hand-off checkpoints its last step and stops there."""
        if method in LORA_RPCS:
            self._check_open()
            if method != "list_loras" and not self.sleep.wait_awake():     # the factors follow the weights
                raise StageUnavailableError(f"{method}: the stage is waking from sleep; retry")
            return self.loras.control(method, tuple(args), kwargs or {})
        if method in OWNED_RPCS:           # sleep and the profiler: only through their controls, never bare
            self._check_open()
            return OWNED_RPCS[method](self, *args, **(kwargs or {}))
        return self.rank_rpc(method, args, kwargs, timeout, unique_reply_rank, abort_with)

    def rank_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None, timeout: float | None = None,
                 unique_reply_rank: int | None = None, abort_with: tuple[str, ...] = ()) -> Any:
        self._check_open()
        if self._thread is None:
            with self._rpc_lock:
                try:
                    return self.executor.collective_rpc(method, args, kwargs, timeout, unique_reply_rank)
                finally:
                    self.abort(list(abort_with))
        with self._lock:                 # one _schedule() takes both: the aborts, then the RPC before any execute
            future = self._rpcs.submit(method, args, kwargs, unique_reply_rank)
            self.abort(list(abort_with))
            self._lock.notify_all()
        return self._rpcs.wait(future, method, timeout)
