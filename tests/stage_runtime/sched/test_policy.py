"""Scheduling policies: the order each one serves, aging, preemption at tick boundaries and deadlines.

Driven through the schedulers with hand-made runner outputs (no model): each tick advances every
scheduled request one step, as the runner would.
"""

from __future__ import annotations

import numpy as np
import pytest

from stage_runtime.config import SchedulerConfig
from stage_runtime.outputs import BatchRunnerOutput, RunnerOutput
from stage_runtime.request import RequestStatus
from stage_runtime.sched import RequestScheduler, StepScheduler
from stage_runtime.sched.policy import POLICIES, FcfsPolicy, PriorityPolicy, SrptPolicy
from support.factories import make_request

IMG = np.zeros((1, 8, 8, 3), np.uint8)


def step_sched(policy: str, cap: int = 1, **kw) -> StepScheduler:
    return StepScheduler(SchedulerConfig(execution_mode="step", max_num_seqs=cap, scheduling_policy=policy,
                                         aging_ticks=kw.pop("aging_ticks", 0), **kw))


def add(s, rid: str, steps: int = 4, priority: int = 0, width: int = 64, **kw) -> None:
    s.add_request(make_request(rid, num_inference_steps=steps, priority=priority, width=width, height=64,
                               guidance_scale=7.5, seed=1, **kw))


def tick(s: StepScheduler):
    """One schedule → (every scheduled request advances one step) → update; returns (out, finished)."""
    out = s.schedule()
    results = []
    for rid in out.scheduled_request_ids:
        st = s.get_request_state(rid)
        k = st.step_index + 1
        done = k >= st.request.num_steps
        results.append(RunnerOutput(rid, images=IMG if done else None, step_index=k, finished=done))
    finished = s.update_from_output(out, BatchRunnerOutput.of(*results))
    for rid in finished:
        s.pop_request_state(rid)
    return out, finished


@pytest.mark.parametrize("policy, arrivals, order", [
    # (rid, steps, priority) added in this order; capacity 1, request mode: the order waves run in
    ("fcfs", [("a", 8, 0), ("b", 2, 5), ("c", 4, 9)], ["a", "b", "c"]),
    ("priority", [("a", 8, 0), ("b", 2, 5), ("c", 4, 9)], ["c", "b", "a"]),
    ("priority", [("a", 8, 1), ("b", 2, 1), ("c", 4, 0)], ["a", "b", "c"]),      # ties: admission order
    ("srpt", [("a", 8, 0), ("b", 2, 0), ("c", 4, 9)], ["b", "c", "a"]),
    ("srpt", [("a", 4, 0), ("b", 4, 0)], ["a", "b"]),
])
def test_request_mode_runs_waves_in_policy_order(policy, arrivals, order):
    s = RequestScheduler(SchedulerConfig(scheduling_policy=policy, aging_ticks=0))
    for rid, steps, prio in arrivals:
        add(s, rid, steps, prio)
    ran = []
    while s.has_requests():
        out = s.schedule()
        ran += out.scheduled_request_ids
        for rid in s.update_from_output(out, BatchRunnerOutput.of(
                *(RunnerOutput(r, images=IMG, step_index=1) for r in out.scheduled_request_ids))):
            s.pop_request_state(rid)
    assert ran == order


def test_request_mode_fuses_in_rank_order_until_the_first_other_key_and_never_preempts():
    s = RequestScheduler(SchedulerConfig(scheduling_policy="priority", max_num_seqs=3))
    add(s, "low", priority=0, width=64)
    add(s, "wide", priority=5, width=128)
    add(s, "high", priority=9, width=64)
    add(s, "high2", priority=7, width=64)
    out = s.schedule()
    assert out.scheduled_request_ids == ["high", "high2"] and not out.preempted_req_ids  # "wide" stops the wave


@pytest.mark.parametrize("cls, priority, steps, done, age_ticks, expected", [
    (FcfsPolicy, 9, 10, 0, 0, (0, 1)),
    (PriorityPolicy, 3, 10, 0, 0, (-3, 1)),
    (PriorityPolicy, 3, 10, 0, 25, (-5, 1)),        # aging 10: two levels after 25 ticks
    (SrptPolicy, 0, 10, 4, 0, (6, 1)),
    (SrptPolicy, 0, 10, 4, 30, (3, 1)),             # three steps less after 30 ticks
])
def test_rank_table(cls, priority, steps, done, age_ticks, expected):
    s = step_sched("fcfs")
    add(s, "r", steps, priority)
    st = s.get_request_state("r")
    st.step_index = done
    assert cls(aging_ticks=10).rank(st, st.admitted_tick + age_ticks) == expected
    assert set(POLICIES) == {"fcfs", "priority", "srpt"}


@pytest.mark.parametrize("policy, low, high, preempts", [
    ("priority", dict(steps=20, priority=0), dict(steps=20, priority=1), True),
    ("priority", dict(steps=20, priority=1), dict(steps=2, priority=1), False),    # equal rank: no preemption
    ("srpt", dict(steps=20), dict(steps=4), True),
    ("srpt", dict(steps=8), dict(steps=20), False),               # 3 left beats 20
    ("fcfs", dict(steps=20, priority=0), dict(steps=2, priority=9), False),
])
def test_a_better_ranked_arrival_preempts_at_the_next_tick_boundary(policy, low, high, preempts):
    s = step_sched(policy)
    add(s, "L", **low)
    for _ in range(5):
        tick(s)
    add(s, "H", **high)
    out, _ = tick(s)
    L = s.get_request_state("L")
    if preempts:
        assert out.preempted_req_ids == ["L"] and out.scheduled_request_ids == ["H"]
        assert L.status == RequestStatus.PREEMPTED and L.step_index == 5 and L.preemptions == 1
        while s.get_request_state("H") is not None:
            tick(s)
        out, _ = tick(s)
        assert out.resumed_req_ids == ["L"] and s.get_request_state("L").step_index == 6
    else:
        assert out.preempted_req_ids == [] and out.scheduled_request_ids == ["L"]
    while s.has_requests():
        tick(s)
    assert s.num_states == 0 and s.num_running_reqs == 0 and s.num_waiting_reqs == 0


def test_resume_goes_out_as_a_cached_id_marked_resumed_and_continues_from_its_step():
    s = step_sched("priority")
    add(s, "L", steps=10)
    tick(s), tick(s)
    add(s, "H", steps=1, priority=1)
    out, finished = tick(s)
    assert out.preempted_req_ids == ["L"] and finished == ["H"]
    out, _ = tick(s)
    assert out.resumed_req_ids == ["L"] and out.scheduled_cached_req_ids == ["L"] and not out.scheduled_new_reqs
    assert s.get_request_state("L").status == RequestStatus.RUNNING and s.get_request_state("L").step_index == 3


def test_capacity_two_preempts_only_the_lowest_ranked_running_request():
    s = step_sched("priority", cap=2)
    add(s, "mid", steps=9, priority=1)
    add(s, "low", steps=9, priority=0)
    tick(s)
    add(s, "top", steps=9, priority=5)
    out, _ = tick(s)
    assert out.preempted_req_ids == ["low"] and sorted(out.scheduled_request_ids) == ["mid", "top"]


def test_an_incompatible_winner_preempts_the_whole_running_set_only_when_it_outranks_all():
    s = step_sched("priority", cap=2)
    add(s, "a", priority=0, width=64)
    add(s, "b", priority=2, width=64)
    tick(s)
    add(s, "wide", priority=1, width=128)
    out, _ = tick(s)
    assert out.preempted_req_ids == []                      # it outranks a, not b: nothing moves
    add(s, "wider", priority=3, width=128)
    out, _ = tick(s)
    assert sorted(out.preempted_req_ids) == ["a", "b"] and out.scheduled_request_ids[0] == "wider"


@pytest.mark.parametrize("max_preemptions", [0, 1, 3])
def test_starvation_bound_under_a_continuous_stream_of_high_priority_requests(max_preemptions):
    # A new high-priority request every tick; aging (4 ticks per level) brings the low one back each time.
    s = step_sched("priority", max_preemptions=max_preemptions, aging_ticks=4)
    add(s, "low", steps=12, priority=0)
    tick(s)
    preemptions, n = 0, 0
    while s.get_request_state("low") is not None:
        n += 1
        add(s, f"h{n}", steps=2, priority=3 if n % 8 else 60)     # every 8th one outranks anything aged
        out, finished = tick(s)
        preemptions += "low" in out.preempted_req_ids
        assert n < 500, "the low-priority request never finished"
    assert preemptions == max_preemptions                  # preempted up to the bound, then ran to its end
    while s.has_requests():
        tick(s)
    assert s.num_states == 0


def test_aging_lets_a_preempted_request_back_in_under_a_continuous_stream():
    s = step_sched("priority", max_preemptions=1, aging_ticks=2, cap=1)
    add(s, "low", steps=4, priority=0)
    tick(s)
    for n in range(60):
        if s.get_request_state("low") is None:
            break
        add(s, f"h{n}", steps=3, priority=3)
        tick(s)
    assert s.get_request_state("low") is None             # finished: aging outranked the stream


def test_deadlines_end_queued_requests_unrun_and_running_ones_at_the_boundary():
    s = step_sched("fcfs")
    add(s, "run", steps=10, timeout_s=5.0)
    add(s, "queued", steps=2, timeout_s=1.0)
    tick(s)
    t0 = s.get_request_state("run").request.arrival_time
    assert s.expire_deadlines(now=t0 + 0.5) == []
    assert s.expire_deadlines(now=t0 + 1.5) == ["queued"]
    q = s.pop_request_state("queued")
    assert q.status == RequestStatus.FINISHED_ERROR and q.error_type == "deadline_exceeded" and q.step_index == 0
    assert s.expire_deadlines(now=t0 + 6) == ["run"]
    r = s.pop_request_state("run")
    assert r.error_type == "deadline_exceeded" and r.step_index == 1 and "timeout_s=5" in r.error
    assert s.schedule().finished_req_ids == {"run", "queued"}      # the runner drops their state
    assert s.num_states == 0 and not s.has_requests()


def test_a_stage_default_timeout_applies_to_requests_without_one():
    s = step_sched("fcfs", default_timeout_s=2.0)
    add(s, "a")
    add(s, "b", timeout_s=9.0)
    assert s.get_request_state("a").deadline - s.get_request_state("a").request.arrival_time == pytest.approx(2.0)
    assert s.get_request_state("b").deadline - s.get_request_state("b").request.arrival_time == pytest.approx(9.0)


def test_a_preempted_request_can_be_aborted_and_leaves_nothing():
    s = step_sched("priority")
    add(s, "L", steps=10)
    tick(s)
    add(s, "H", steps=5, priority=1)
    tick(s)
    assert s.finish_requests("L", RequestStatus.FINISHED_ABORTED) == ["L"]
    s.pop_request_state("L")
    while s.has_requests():
        tick(s)
    assert s.num_states == 0 and s.num_waiting_reqs == 0
