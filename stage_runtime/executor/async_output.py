"""AsyncOutputTable: request-mode outputs that arrive after their COMPUTE_DONE, keyed by async output id.

A rank answers a request-mode wave twice: COMPUTE_DONE (the device is free; the engine retires the
requests and schedules the next wave) and OUTPUT_READY (the images). The two travel on different
threads of the rank and may arrive in either order, so every id is in exactly one of three places:

    waiters    the engine asked first (``wait``): a future, resolved when the images arrive
    completed  the images arrived first: kept until the engine asks for them (or drops them)
    dropped    the engine gave up first (abort, client gone): the images are discarded on arrival

Futures are resolved outside the lock (their callbacks take the engine's lock). Arrays arrive already
unpacked — their shared memory is unlinked before they reach this table — so dropping is just
forgetting. ``fail_all`` (executor shutdown or death) fails every waiter and forgets everything.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any


class AsyncOutputTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[str, concurrent.futures.Future] = {}
        self._completed: dict[str, Any] = {}
        self._failed: dict[str, str] = {}
        self._dropped: set[str] = set()
        self._error: BaseException | None = None

    def wait(self, async_id: str) -> concurrent.futures.Future:
        """A future for the images of ``async_id`` (already resolved when they came first)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if async_id in self._completed:
                future.set_result(self._completed.pop(async_id))
            elif async_id in self._failed:
                future.set_exception(RuntimeError(self._failed.pop(async_id)))
            elif self._error is not None:
                future.set_exception(self._error)
            else:
                self._waiters[async_id] = future
        return future

    def drop(self, async_id: str) -> None:
        """The engine no longer wants ``async_id``: forget it now, or discard it when it arrives."""
        with self._lock:
            waiter = self._waiters.pop(async_id, None)
            if self._completed.pop(async_id, None) is None and self._failed.pop(async_id, None) is None:
                if self._error is None:
                    self._dropped.add(async_id)
        if waiter is not None:
            waiter.cancel()

    def deliver(self, images: dict[str, Any], failed: dict[str, str] | None = None) -> None:
        """OUTPUT_READY: resolve waiters, cache the rest, discard dropped ids."""
        resolved: list[tuple[concurrent.futures.Future, Any, str | None]] = []
        with self._lock:
            for async_id, value in list(images.items()) + [(k, None) for k in (failed or {})]:
                error = (failed or {}).get(async_id)
                if async_id in self._dropped:
                    self._dropped.discard(async_id)
                elif async_id in self._waiters:
                    resolved.append((self._waiters.pop(async_id), value, error))
                elif error is not None:
                    self._failed[async_id] = error
                else:
                    self._completed[async_id] = value
        for future, value, error in resolved:
            if future.set_running_or_notify_cancel():     # a future cancelled concurrently is skipped
                if error is None:
                    future.set_result(value)
                else:
                    future.set_exception(RuntimeError(error))

    def fail_all(self, error: BaseException) -> None:
        with self._lock:
            self._error = error
            waiters, self._waiters = self._waiters, {}
            self._completed.clear()
            self._failed.clear()
            self._dropped.clear()
        for future in waiters.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(error)

    def __len__(self) -> int:
        """Ids held in any of the three places (0 when nothing is pending)."""
        with self._lock:
            return len(self._waiters) + len(self._completed) + len(self._failed) + len(self._dropped)
