"""Scheduling policies: which request goes first, and whether a waiting request may displace a running one.

A policy only ranks (a lower rank goes first; ties go to the earlier admission). The scheduler keeps
every other rule as it is: capacity, batch compatibility and head-of-line blocking in rank order.

    fcfs       admission order; never preempts (the FIFO of before)
    priority   higher ``priority`` first; a waiting request outranking a running one preempts it (step mode)
    srpt       fewest remaining denoising steps first; preempts likewise

Aging bounds starvation in ``priority`` and ``srpt``: every ``aging_ticks`` ticks since its admission a
request gains one level (``priority``) or counts one step less (``srpt``), so it eventually outranks
every later arrival; ``max_preemptions`` bounds how often a running request is displaced. With both,
every request finishes under any arrival stream. With ``aging_ticks=0`` a continuous stream of
better-ranked arrivals can keep a waiting (or preempted) request waiting.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from stage_runtime.config import SchedulerConfig
from stage_runtime.sched.request_state import RequestState

Rank = tuple[float, int]


class SchedulingPolicy(ABC):
    name: ClassVar[str]
    preempts: ClassVar[bool] = True

    def __init__(self, aging_ticks: int = 0):
        self.aging_ticks = aging_ticks

    def age(self, state: RequestState, tick: int) -> int:
        """Levels gained by waiting: whole ``aging_ticks`` periods since admission (0 with aging off)."""
        return (tick - state.admitted_tick) // self.aging_ticks if self.aging_ticks else 0

    @abstractmethod
    def rank(self, state: RequestState, tick: int) -> Rank:
        """Lower goes first; the second element (admission order) breaks ties."""

    def order(self, states: list[RequestState], tick: int) -> list[RequestState]:
        return sorted(states, key=lambda st: self.rank(st, tick))


class FcfsPolicy(SchedulingPolicy):
    name = "fcfs"
    preempts = False

    def rank(self, state: RequestState, tick: int) -> Rank:
        return (0, state.seq)


class PriorityPolicy(SchedulingPolicy):
    name = "priority"

    def rank(self, state: RequestState, tick: int) -> Rank:
        return (-(state.request.sampling.priority + self.age(state, tick)), state.seq)


class SrptPolicy(SchedulingPolicy):
    name = "srpt"

    def rank(self, state: RequestState, tick: int) -> Rank:
        remaining = state.request.num_steps - state.step_index
        return (remaining - self.age(state, tick), state.seq)


POLICIES: dict[str, type[SchedulingPolicy]] = {cls.name: cls for cls in (FcfsPolicy, PriorityPolicy, SrptPolicy)}


def make_policy(config: SchedulerConfig) -> SchedulingPolicy:
    return POLICIES[config.scheduling_policy](config.aging_ticks)
