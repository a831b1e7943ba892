"""Waiting for an observable condition: the one ``wait_until`` of the test suite (sync and asyncio).

A test waits for something it can see (a state, a counter, an event) and fails with what it waited for;
it never sleeps as evidence that something did not happen.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")
POLL_S = 0.002


def wait_until(predicate: Callable[[], T], timeout: float = 30.0, what: str = "condition", poll: float = POLL_S) -> T:
    """Poll ``predicate`` (every ``poll`` seconds) until it returns something truthy; return it.
    AssertionError naming ``what`` once ``timeout`` seconds have passed without it."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(poll)


async def async_wait_until(predicate: Callable[[], Any | Awaitable[Any]], timeout: float = 30.0,
                           what: str = "condition") -> Any:
    """``wait_until`` for a sync or async predicate, without blocking the event loop."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        await asyncio.sleep(0.02)
