"""RequestStream: one request's outputs, filled by the engine thread, read from sync code or asyncio.

Items arrive in order; the last one has ``finished=True``. ``put`` may be called from any thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque

from stage_runtime.errors import from_wire
from stage_runtime.outputs import DiffusionOutput


def raise_for_output(output: DiffusionOutput) -> DiffusionOutput:
    """Return a successful final output; raise the error tree's class of its ``error_type`` for a failed one."""
    if output.error is None:
        return output
    raise from_wire(output.error_type, output.error)


class RequestStream:
    def __init__(self, request_id: str):
        self.request_id = request_id
        self._items: deque[DiffusionOutput] = deque()
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self.finished = False           # the final item was put
        self.closed = False             # the consumer went away: further items are dropped

    def put(self, output: DiffusionOutput) -> None:
        with self._cond:
            if self.finished or self.closed:
                return
            self._items.append(output)
            self.finished = output.finished
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_wake, fut)
            except RuntimeError:      # the consumer's loop is closed: nobody is waiting any more
                continue

    # -- sync ------------------------------------------------------------------------------------------
    def get(self, timeout: float | None = None) -> DiffusionOutput:
        with self._cond:
            if not self._cond.wait_for(lambda: self._items, timeout):
                raise TimeoutError(f"no output for request {self.request_id} within {timeout} s")
            return self._items.popleft()

    def __iter__(self):
        while True:
            item = self.get()
            yield item
            if item.finished:
                return

    def result(self, timeout: float | None = None) -> DiffusionOutput:
        """Wait for the final output; raise RequestAbortedError / RequestFailedError / EngineClosedError…"""
        while True:
            item = self.get(timeout)
            if item.finished:
                return raise_for_output(item)

    # -- asyncio ---------------------------------------------------------------------------------------
    async def aget(self) -> DiffusionOutput:
        while True:
            with self._cond:
                if self._items:
                    return self._items.popleft()
                loop = asyncio.get_running_loop()
                fut = loop.create_future()
                self._waiters.append((loop, fut))
            await fut

    async def __aiter__(self):
        while True:
            item = await self.aget()
            yield item
            if item.finished:
                return

    async def aresult(self) -> DiffusionOutput:
        while True:
            item = await self.aget()
            if item.finished:
                return raise_for_output(item)

    def close(self) -> None:
        """The consumer is gone: drop anything further (request state is still finalised by the engine)."""
        with self._cond:
            self.closed = True
            self._items.clear()


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
