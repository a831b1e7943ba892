"""ControlRpcQueue: control RPCs asked from any thread, run on the engine thread between steps.

Every executor call happens on the busy-loop thread, so an RPC never interleaves with a wave or a tick
on the transport: callers enqueue (``submit``), the engine drains the queue at the top of each step
(``run``), and a caller that stops waiting cancels its entry. Only declared control RPCs are queued
(``stage_runtime.control``); an undeclared name is refused before it is queued.
"""

from __future__ import annotations

import concurrent.futures
from collections import deque
from typing import Any

from stage_runtime.control import check_control_rpc
from stage_runtime.errors import EngineClosedError, RpcError


class ControlRpcQueue:
    def __init__(self) -> None:
        self._items: deque[tuple[str, tuple, dict, int | None, concurrent.futures.Future]] = deque()

    def __bool__(self) -> bool:
        return bool(self._items)

    def submit(self, method: str, args: tuple, kwargs: dict | None, unique_reply_rank: int | None
               ) -> concurrent.futures.Future:
        """Queue one RPC (call with the engine lock held, then notify the loop)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._items.append((check_control_rpc(method), tuple(args), kwargs or {}, unique_reply_rank, future))
        return future

    @staticmethod
    def wait(future: concurrent.futures.Future, method: str, timeout: float | None) -> Any:
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise RpcError(f"collective_rpc {method!r} got no answer within timeout={timeout} s") from None

    def take(self) -> deque:
        """Everything queued so far (call with the engine lock held); run it with ``run``."""
        items, self._items = self._items, deque()
        return items

    @staticmethod
    def run(items: deque, executor) -> None:
        """Run taken RPCs on the executor (engine thread, lock released); each caller gets its reply."""
        for method, args, kwargs, reply_rank, future in items:
            if not future.set_running_or_notify_cancel():
                continue                              # the caller gave up (timeout / cancel)
            try:
                future.set_result(executor.collective_rpc(method, args, kwargs, None, reply_rank))
            except Exception as exc:
                future.set_exception(exc)

    def fail_all(self, message: str) -> None:
        """The engine is shutting down: every queued caller gets EngineClosedError."""
        while self._items:
            future = self._items.popleft()[-1]
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineClosedError(message))
