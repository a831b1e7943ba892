"""StepScheduler: one step per tick, joins at tick boundaries by step key, different step counts share ticks."""

from __future__ import annotations

import numpy as np
import pytest

from stage_runtime.config import SchedulerConfig
from stage_runtime.outputs import BatchRunnerOutput, RunnerOutput
from stage_runtime.request import DiffusionRequest, RequestStatus, SamplingParams
from stage_runtime.sched import StepScheduler

IMG = np.zeros((1, 8, 8, 3), np.uint8)


def req(rid: str, steps: int = 3, width: int = 64, guidance: float = 7.5) -> DiffusionRequest:
    return DiffusionRequest(rid, "p", SamplingParams(width=width, height=64, num_inference_steps=steps,
                                                      guidance_scale=guidance, seed=1))


def tick(s: StepScheduler, steps_done: dict[str, int], total: dict[str, int]) -> tuple[list[str], list[str]]:
    """Run one schedule/update cycle advancing every scheduled request by one step."""
    out = s.schedule()
    results = []
    for rid in out.scheduled_request_ids:
        steps_done[rid] = steps_done.get(rid, 0) + 1
        done = steps_done[rid] >= total[rid]
        results.append(RunnerOutput(rid, images=IMG if done else None, step_index=steps_done[rid], finished=done))
    return out.scheduled_request_ids, s.update_from_output(out, BatchRunnerOutput.of(*results))


def test_multi_step_lifecycle_writes_back_step_index():
    s = StepScheduler(SchedulerConfig(execution_mode="step"))
    s.add_request(req("a", steps=3))
    done, total = {}, {"a": 3}
    for k in (1, 2):
        assert tick(s, done, total) == (["a"], [])
        state = s.get_request_state("a")
        assert state.status == RequestStatus.RUNNING and state.step_index == k
    assert tick(s, done, total) == (["a"], ["a"])
    assert s.get_request_state("a").status == RequestStatus.FINISHED_COMPLETED


def test_different_step_counts_share_ticks_and_leave_when_done():
    s = StepScheduler(SchedulerConfig(execution_mode="step", max_num_seqs=4))
    s.add_request(req("long", steps=5))
    done, total = {}, {"long": 5, "short": 2}
    tick(s, done, total)
    s.add_request(req("short", steps=2))           # joins at the next tick boundary
    scheduled, finished = tick(s, done, total)
    assert scheduled == ["short", "long"] or sorted(scheduled) == ["long", "short"]
    scheduled, finished = tick(s, done, total)
    assert finished == ["short"]                    # the short one finishes first
    assert tick(s, done, total)[0] == ["long"]


def test_capacity_and_incompatible_head():
    s = StepScheduler(SchedulerConfig(execution_mode="step", max_num_seqs=2))
    for rid in "ab":
        s.add_request(req(rid))
    s.add_request(req("c"))
    assert s.schedule().scheduled_request_ids == ["a", "b"]
    t = StepScheduler(SchedulerConfig(execution_mode="step", max_num_seqs=4))
    t.add_request(req("a"))
    t.add_request(req("b", width=96))
    t.add_request(req("c"))
    assert t.schedule().scheduled_request_ids == ["a"]


@pytest.mark.parametrize("output, status, error", [
    (None, RequestStatus.FINISHED_ERROR, "No output for request a"),
    (RunnerOutput("a", aborted=True), RequestStatus.FINISHED_ABORTED, None),
    (RunnerOutput("a", error="bad"), RequestStatus.FINISHED_ERROR, "bad"),
    (RunnerOutput("a", finished=False), RequestStatus.FINISHED_ERROR, "Missing step_index in output for request a"),
    (RunnerOutput("a", step_index=3, finished=True), RequestStatus.FINISHED_ERROR, "No output result for request a"),
])
def test_update_rules(output, status, error):
    s = StepScheduler(SchedulerConfig(execution_mode="step"))
    s.add_request(req("a"))
    out = s.schedule()
    assert s.update_from_output(out, BatchRunnerOutput.of(output) if output else BatchRunnerOutput()) == ["a"]
    state = s.get_request_state("a")
    assert (state.status, state.error) == (status, error)


def test_abort_between_schedule_and_update_is_reported_to_workers():
    s = StepScheduler(SchedulerConfig(execution_mode="step"))
    s.add_request(req("a", steps=5))
    out = s.schedule()
    assert s.finish_requests("a", RequestStatus.FINISHED_ABORTED) == ["a"]
    assert s.update_from_output(out, BatchRunnerOutput.of(RunnerOutput("a", step_index=1, finished=False))) == []
    assert s.get_request_state("a").status == RequestStatus.FINISHED_ABORTED
    assert s.schedule().finished_req_ids == {"a"}        # the runner drops its step state next tick
