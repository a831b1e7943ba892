"""The cost meter: outstanding and completed work in pixel-steps over the live and finished request states, the
completion rate over a window of reads (a test clock), the adapters the waiting requests name."""

from __future__ import annotations

from support.factories import make_request, model_info

from stage_runtime.engine.cost_meter import CostMeter, step_cost
from stage_runtime.request import LoraRef, RequestStatus
from stage_runtime.sched.request_state import RequestState

INFO = model_info(default_height=512, default_width=512)


def state(rid: str, status: RequestStatus = RequestStatus.WAITING, step: int = 0, loras=(), **sampling) -> RequestState:
    request = make_request(rid, loras=tuple(LoraRef(name=n) for n in loras), **sampling).resolve(INFO)
    return RequestState(request, key=rid, status=status, step_index=step)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_step_costs_pixels_times_frames_times_outputs():
    assert step_cost(state("a", height=256, width=128, num_outputs=3).request) == 256 * 128 * 3


def test_outstanding_is_the_steps_left_times_the_step_cost_over_waiting_and_running():
    big = state("big", RequestStatus.RUNNING, step=10, height=1024, width=1024, num_inference_steps=50)
    small = state("small", height=256, width=256, num_inference_steps=20, num_outputs=2)
    snap = CostMeter(clock=Clock()).snapshot([big, small])
    assert snap["outstanding"] == 40 * 1024 * 1024 + 20 * 256 * 256 * 2
    assert snap["completed_total"] == 10 * 1024 * 1024                 # the running one's steps so far
    assert snap["rate"] == 0.0                                          # one read: no rate yet


def test_completed_work_keeps_counting_as_requests_finish_and_the_rate_follows_the_reads():
    clock = Clock()
    meter = CostMeter(window=60.0, clock=clock)
    running = state("r", RequestStatus.RUNNING, step=2, height=64, width=64, num_inference_steps=10)
    first = meter.snapshot([running])
    assert first["completed_total"] == 2 * 4096 and first["rate"] == 0.0
    clock.now += 10
    running.step_index = 6
    assert meter.snapshot([running])["rate"] == (4 * 4096) / 10
    clock.now += 10
    running.step_index, running.status = 10, RequestStatus.FINISHED_COMPLETED
    meter.finished([running])                                          # leaves the scheduler with its 10 steps
    last = meter.snapshot([])
    assert last["completed_total"] == 10 * 4096 and last["outstanding"] == 0
    assert last["rate"] == (8 * 4096) / 20
    clock.now += 200                                                   # the window moves: older reads drop
    assert meter.snapshot([])["rate"] == 0.0


def test_the_adapters_of_waiting_and_preempted_requests_are_listed_once_and_sorted():
    live = [state("w1", loras=("ink", "pixel")), state("w2", RequestStatus.PREEMPTED, step=1, loras=("zebra",)),
            state("r", RequestStatus.RUNNING, step=1, loras=("running-only",)), state("w3", loras=("ink",))]
    assert CostMeter(clock=Clock()).snapshot(live)["waiting_loras"] == ["ink", "pixel", "zebra"]
