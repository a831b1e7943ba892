"""RequestScheduler / BaseScheduler: FIFO, capacity, compatibility, head-of-line stop, terminal transitions."""

from __future__ import annotations

import numpy as np
import pytest

from stage_runtime.config import SchedulerConfig
from stage_runtime.errors import DuplicateRequestError, QueueFullError
from stage_runtime.outputs import BatchRunnerOutput, RunnerOutput
from stage_runtime.request import DiffusionRequest, RequestStatus, SamplingParams
from stage_runtime.sched import RequestScheduler

IMG = np.zeros((1, 8, 8, 3), np.uint8)


def req(rid: str, width: int = 64, steps: int = 4, guidance: float = 7.5) -> DiffusionRequest:
    return DiffusionRequest(rid, "p", SamplingParams(width=width, height=64, num_inference_steps=steps,
                                                      guidance_scale=guidance, seed=1))


def sched(**kw) -> RequestScheduler:
    return RequestScheduler(SchedulerConfig(**kw))


def ok(*ids: str) -> BatchRunnerOutput:
    return BatchRunnerOutput.of(*(RunnerOutput(rid, images=IMG, step_index=4) for rid in ids))


def test_single_request_lifecycle():
    s = sched()
    s.add_request(req("a"))
    assert s.get_request_state("a").status == RequestStatus.WAITING and s.has_requests()
    out = s.schedule()
    assert [n.request_id for n in out.scheduled_new_reqs] == ["a"] and not out.scheduled_cached_req_ids
    assert s.get_request_state("a").status == RequestStatus.RUNNING
    assert s.update_from_output(out, ok("a")) == ["a"]
    assert s.get_request_state("a").status == RequestStatus.FINISHED_COMPLETED
    assert not s.has_requests()
    s.pop_request_state("a")
    assert s.num_states == 0
    assert s.schedule().finished_req_ids == {"a"}          # reported once to the workers, then gone
    assert s.schedule().finished_req_ids == set()


def test_duplicate_id_rejected_while_in_flight_and_after_pop_accepted():
    s = sched()
    s.add_request(req("a"))
    with pytest.raises(DuplicateRequestError, match="'a'"):
        s.add_request(req("a"))
    s.update_from_output(s.schedule(), ok("a"))
    with pytest.raises(DuplicateRequestError):             # terminal but not yet delivered
        s.add_request(req("a"))
    s.pop_request_state("a")
    s.add_request(req("a"))


def test_fifo_with_capacity_one():
    s = sched(max_num_seqs=1)
    s.add_request(req("a"))
    s.add_request(req("b"))
    first = s.schedule()
    assert first.scheduled_request_ids == ["a"] and first.num_waiting_reqs == 1
    s.update_from_output(first, ok("a"))
    assert s.schedule().scheduled_request_ids == ["b"]


def test_capacity_admits_compatible_requests_in_one_wave():
    s = sched(max_num_seqs=2)
    for rid in "abc":
        s.add_request(req(rid))
    out = s.schedule()
    assert out.scheduled_request_ids == ["a", "b"]
    assert s.num_running_reqs == 2 and s.num_waiting_reqs == 1


@pytest.mark.parametrize("field", [dict(width=96), dict(steps=8), dict(guidance=1.0)])
def test_incompatible_head_blocks_later_compatible_request(field):
    s = sched(max_num_seqs=4)
    s.add_request(req("a"))
    s.add_request(req("b", **field))       # incompatible head
    s.add_request(req("c"))                # compatible with a, but behind b: never jumps the queue
    out = s.schedule()
    assert out.scheduled_request_ids == ["a"]
    s.update_from_output(out, ok("a"))
    assert s.schedule().scheduled_request_ids == ["b"]


def test_bounded_waiting_queue():
    s = sched(max_waiting=2)
    s.add_request(req("a"))
    s.add_request(req("b"))
    with pytest.raises(QueueFullError, match="max_waiting=2"):
        s.add_request(req("c"))
    assert s.num_states == 2                   # the rejected request left nothing behind


def test_abort_waiting_and_running():
    s = sched(max_num_seqs=1)
    s.add_request(req("a"))
    s.add_request(req("b"))
    out = s.schedule()
    assert s.finish_requests(["a", "b", "zzz"], RequestStatus.FINISHED_ABORTED) == ["a", "b"]
    assert s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED) == []     # idempotent
    assert s.get_request_state("b").status == RequestStatus.FINISHED_ABORTED
    # a result arriving for the aborted request does not resurrect it
    assert s.update_from_output(out, ok("a")) == []
    assert s.get_request_state("a").status == RequestStatus.FINISHED_ABORTED
    assert s.schedule().is_empty
    assert not s.has_requests()


@pytest.mark.parametrize("runner_output, status, error", [
    (RunnerOutput("a", error="boom"), RequestStatus.FINISHED_ERROR, "boom"),
    (RunnerOutput("a", aborted=True), RequestStatus.FINISHED_ABORTED, None),
    (None, RequestStatus.FINISHED_ERROR, "No output result for request a"),
    (RunnerOutput("a"), RequestStatus.FINISHED_ERROR, "No output result for request a"),
])
def test_update_rules(runner_output, status, error):
    s = sched()
    s.add_request(req("a"))
    out = s.schedule()
    result = BatchRunnerOutput.of(runner_output) if runner_output else BatchRunnerOutput()
    assert s.update_from_output(out, result) == ["a"]
    state = s.get_request_state("a")
    assert state.status == status and state.error == error


def test_results_map_by_id_not_position():
    s = sched(max_num_seqs=2)
    s.add_request(req("a"))
    s.add_request(req("b"))
    out = s.schedule()
    img_b = np.ones((1, 8, 8, 3), np.uint8)
    s.update_from_output(out, BatchRunnerOutput.of(RunnerOutput("b", images=img_b), RunnerOutput("a", images=IMG)))
    assert s.get_request_state("b").result.images is img_b


def test_admission_wait_holds_first_wave_until_stable_window():
    s = sched(max_num_seqs=4, request_batch_max_wait_ms=1000)
    s.add_request(req("a"))
    now = s._last_add_at
    assert 0 < s.admission_delay(now) <= 0.05 + 1e-9         # stable window: min(50 ms, wait/5)
    assert s.admission_delay(now + 0.051) == 0.0
    for rid in "bcd":                                         # capacity reached: go at once
        s.add_request(req(rid))
    assert s.admission_delay() == 0.0


@pytest.mark.parametrize("kw", [dict(request_batch_max_wait_ms=0, max_num_seqs=4),
                                dict(request_batch_max_wait_ms=100, max_num_seqs=1)])
def test_no_admission_wait_without_wait_or_capacity(kw):
    s = sched(**kw)
    s.add_request(req("a"))
    assert s.admission_delay() == 0.0


def test_no_admission_wait_while_running():
    s = sched(max_num_seqs=4, request_batch_max_wait_ms=1000)
    s.add_request(req("a"))
    s.schedule()
    s.add_request(req("b", width=96))
    assert s.admission_delay() == 0.0


def test_close_clears_everything():
    s = sched()
    s.add_request(req("a"))
    s.schedule()
    s.close()
    assert s.num_states == 0 and not s.has_requests()
