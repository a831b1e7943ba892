"""A part's own view of its time budget: it checks the clock between checks and reports what it had no time for.

The supervisor (``supervise.py``) kills a part that overruns its budget by more than a grace period; this clock
lets a well-behaved part stop first, so that its finished rows stand and the rest read ``budget``.
"""

from __future__ import annotations

import time


class Clock:
    def __init__(self, budget_s: float, reserve_s: float = 0.0):
        self.budget_s = budget_s
        self.started = time.monotonic()
        self.reserve_s = reserve_s          # kept back for the part's cleanup

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float:
        return self.budget_s - self.reserve_s - self.elapsed()

    def spent(self, need_s: float = 0.0) -> bool:
        """True when fewer than ``need_s`` seconds of the budget are left (the next check would overrun)."""
        return self.left() <= need_s

    def reason(self) -> str:
        return f"not run: the part's {self.budget_s:.0f} s budget was spent ({self.elapsed():.0f} s elapsed)"
