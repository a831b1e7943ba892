"""A clock a test sets by hand (``clock.now += 31``): what the job store and its leases read as the time."""

from __future__ import annotations


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now
