"""AsyncOutputTable: request-mode outputs that arrive after their COMPUTE_DONE, keyed by async output id.

A rank answers a request-mode wave twice: COMPUTE_DONE (the device is free; the engine retires the
requests and schedules the next wave) and OUTPUT_READY (the images). The two travel on different
threads of the rank and may arrive in either order, so every id is in exactly one of three places:

    claimed    the engine asked first (``claim``): the hook gets the images when they arrive
    arrived    the images came first: kept until the engine claims them (the hook fires at once) or drops them
    dropped    the engine gave up first (abort, client gone): the images are discarded on arrival

The hook ``(async_id, images | None, error | None)`` is called outside the lock, on the thread that
completed the pair (the result pump, or the engine's when it claims what already arrived). Arrays
arrive already unpacked — their shared memory is unlinked before they reach this table — so dropping
is just forgetting. ``fail_all`` (executor shutdown or death) tells every claimant and forgets everything.
"""

from __future__ import annotations

import threading
from typing import Any

from stage_runtime.outputs import OutputHook


class AsyncOutputTable:
    def __init__(self, hook: OutputHook):
        self._hook = hook
        self._lock = threading.Lock()
        self._claimed: set[str] = set()
        self._arrived: dict[str, tuple[Any, str | None]] = {}      # id → (images, error)
        self._dropped: set[str] = set()
        self._error: str | None = None

    def claim(self, async_id: str) -> None:
        """The engine wants ``async_id``: the hook fires now if it already arrived, else on arrival."""
        with self._lock:
            if async_id in self._arrived:
                ready = (async_id, *self._arrived.pop(async_id))
            elif self._error is not None:
                ready = (async_id, None, self._error)
            else:
                self._claimed.add(async_id)
                return
        self._hook(*ready)

    def drop(self, async_id: str) -> None:
        """The engine no longer wants ``async_id``: forget it now, or discard it when it arrives."""
        with self._lock:
            self._claimed.discard(async_id)
            if self._arrived.pop(async_id, None) is None and self._error is None:
                self._dropped.add(async_id)

    def deliver(self, images: dict[str, Any], failed: dict[str, str] | None = None) -> None:
        """OUTPUT_READY: hand claimed ids to the hook, keep the rest, discard dropped ids."""
        ready: list[tuple[str, Any, str | None]] = []
        with self._lock:
            for async_id, value in list(images.items()) + [(k, None) for k in (failed or {})]:
                error = (failed or {}).get(async_id)
                if async_id in self._dropped:
                    self._dropped.discard(async_id)
                elif async_id in self._claimed:
                    self._claimed.discard(async_id)
                    ready.append((async_id, value, error))
                else:
                    self._arrived[async_id] = (value, error)
        for item in ready:
            self._hook(*item)

    def fail_all(self, error: BaseException) -> None:
        """Every claimed id gets ``error`` through the hook; later claims get it at once."""
        with self._lock:
            self._error = str(error)
            claimed, self._claimed = self._claimed, set()
            self._arrived.clear()
            self._dropped.clear()
        for async_id in sorted(claimed):
            self._hook(async_id, None, self._error)

    def __len__(self) -> int:
        """Ids held in any of the three places (0 when nothing is pending)."""
        with self._lock:
            return len(self._claimed) + len(self._arrived) + len(self._dropped)
