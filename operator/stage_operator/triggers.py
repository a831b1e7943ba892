"""Wake-ups for the per-stage workers: one asyncio.Event per stage, set by watch events, coalesced."""

from __future__ import annotations

import asyncio
from typing import Any


class Triggers:
    """One Event per stage, shared by whoever waits on it (the worker; the deletion handler, which can start
    before the stopped worker has left): it goes when the last of them unregisters."""

    def __init__(self) -> None:
        self._events: dict[tuple[str, str], asyncio.Event] = {}
        self._holders: dict[tuple[str, str], int] = {}

    def register(self, namespace: str, name: str) -> asyncio.Event:
        key = (namespace, name)
        self._holders[key] = self._holders.get(key, 0) + 1
        return self._events.setdefault(key, asyncio.Event())

    def unregister(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        self._holders[key] = self._holders.get(key, 0) - 1
        if self._holders[key] <= 0:
            self._holders.pop(key, None)
            self._events.pop(key, None)

    def fire(self, namespace: str, name: str) -> None:
        if event := self._events.get((namespace, name)):
            event.set()

    def fire_all(self) -> None:
        for event in self._events.values():
            event.set()

    @staticmethod
    async def wait(event: asyncio.Event, timeout: float, stopped: Any = None) -> None:
        """Until the event is set, `stopped` is set, or the resync timeout passes."""
        waiters = [asyncio.ensure_future(event.wait())]
        if stopped is not None:
            waiters.append(asyncio.ensure_future(stopped.wait()))
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
