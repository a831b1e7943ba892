"""Priorities, step-boundary preemption with exact resume, and deadlines — the engine driven by ``step()``.

No busy-loop thread: each ``engine.step()`` is one tick (step mode) or one wave (request mode), so
"the next step" and "within one step" are exact tick counts here, not wall-clock guesses.
"""

from __future__ import annotations

import numpy as np
import pytest

from stage_runtime.engine import DiffusionEngine
from stage_runtime.request import RequestStatus
from stage_runtime.serve.wire import output_message, status_of
from engine_probes import assert_nothing_left, runner_of, threadless
from support.factories import make_request


def runner(engine: DiffusionEngine):
    return runner_of(engine)


@pytest.fixture(scope="module")
def solo_long(tiny_sd_path) -> np.ndarray:
    """The long request alone, uninterrupted, step mode: the image every resumed run must equal bitwise."""
    engine = threadless(tiny_sd_path)
    try:
        stream = engine.add_request(make_request("L", num_inference_steps=12, seed=7))
        while not stream.finished:
            engine.step()
        return stream.result(timeout=0).images
    finally:
        engine.close()


@pytest.fixture(scope="module", params=[0, 1 << 30], ids=["kept-in-place", "offloaded-to-host"])
def priority_engine(request, tiny_sd_path):
    engine = threadless(tiny_sd_path, scheduling_policy="priority", max_preemptions=3,
                        preempted_offload_max_bytes=request.param)
    yield engine
    engine.close()


def test_a_high_priority_arrival_at_step_5_runs_its_first_step_next_tick_and_the_long_one_resumes_bitwise(
        priority_engine, solo_long):
    engine = priority_engine
    long = engine.add_request(make_request("L", num_inference_steps=12, seed=7, priority=0))
    for _ in range(5):
        engine.step()
    assert engine.scheduler.get_request_state("L").step_index == 5
    high = engine.add_request(make_request("H", num_inference_steps=3, seed=3, priority=10))
    engine.step()                                    # the next tick boundary: L preempted, H's first step
    high_st, low_st = engine.scheduler.get_request_state("H"), engine.scheduler.get_request_state("L")
    assert high_st.status == RequestStatus.RUNNING and high_st.step_index == 1
    assert low_st.status == RequestStatus.PREEMPTED and low_st.step_index == 5 and low_st.preemptions == 1
    assert [r["preempted"] for r in engine.requests_snapshot()] == [True, False]
    assert set(runner(engine).parked) == {"L"} and "L" in runner(engine).step_states
    if engine.config.scheduler.preempted_offload_max_bytes:
        assert runner(engine).parked_bytes() > 0       # its latents and conditioning copied to the host
    engine.step(), engine.step()
    assert high.result(timeout=0).step_index == 3 and not long.finished
    engine.step()                                    # the next boundary: L resumes from step 5
    assert engine.scheduler.get_request_state("L").status == RequestStatus.RUNNING
    assert engine.scheduler.get_request_state("L").step_index == 6 and runner(engine).parked == {}
    while not long.finished:
        engine.step()
    out = long.result(timeout=0)
    assert out.step_index == 12 and out.metrics["preemptions"] == 1
    assert np.array_equal(out.images, solo_long)         # bitwise: the same step, the same state
    assert_nothing_left(engine)


def test_max_preemptions_bounds_how_often_a_request_is_displaced_and_it_completes(tiny_sd_path, solo_long):
    engine = threadless(tiny_sd_path, scheduling_policy="priority", max_preemptions=2, aging_ticks=0)
    try:
        long = engine.add_request(make_request("L", num_inference_steps=12, seed=7))
        n = 0
        while not long.finished:
            engine.step()
            l_state = engine.scheduler.get_request_state("L")
            if l_state is not None and l_state.status == RequestStatus.RUNNING and \
                    engine.scheduler.get_request_state(f"h{n}") is None:
                n += 1                         # whenever L runs again, a new high-priority request arrives
                engine.add_request(make_request(f"h{n}", num_inference_steps=1, seed=n, priority=5))
            assert n < 60
        out = long.result(timeout=0)
        assert out.metrics["preemptions"] == 2 and n == 3          # the third high one waited for L's end
        assert np.array_equal(out.images, solo_long)
        engine.abort_all()
        assert_nothing_left(engine)
    finally:
        engine.close()


def test_a_queued_request_past_its_deadline_gets_504_with_step_0_and_a_running_one_stops_at_the_next_step(
        tiny_sd_path):
    engine = threadless(tiny_sd_path)
    try:
        running = engine.add_request(make_request("run", num_inference_steps=20, seed=1, timeout_s=60))
        queued = engine.add_request(make_request("queued", num_inference_steps=2, seed=2, timeout_s=0.5))
        engine.step(), engine.step()
        engine.scheduler.get_request_state("queued").deadline = 0.0          # its deadline has passed
        engine.step()
        out = queued.get(timeout=0)
        assert out.error_type == "deadline_exceeded" and out.step_index == 0
        msg = output_message(out)
        assert msg["type"] == "error" and msg["status_code"] == status_of("deadline_exceeded") == 504
        assert engine.scheduler.get_request_state("run").step_index == 3
        engine.scheduler.get_request_state("run").deadline = 0.0
        engine.step()                                                          # the next boundary
        out = running.get(timeout=0)
        assert out.error_type == "deadline_exceeded" and out.step_index == 3
        assert "deadline" in out.error and "run" in out.error
        assert_nothing_left(engine)
    finally:
        engine.close()


def test_request_mode_runs_waves_in_priority_order(tiny_sd_path):
    engine = threadless(tiny_sd_path, mode="request", scheduling_policy="priority")
    try:
        streams = {rid: engine.add_request(make_request(rid, num_inference_steps=1, seed=1, priority=p))
                   for rid, p in (("low", 0), ("mid", 1), ("top", 9))}
        order = []
        while len(order) < 3:
            engine.step()
            order += [rid for rid, s in streams.items() if s.finished and rid not in order]
        assert order == ["top", "mid", "low"]
        assert_nothing_left(engine)
    finally:
        engine.close()


def test_a_running_request_mode_wave_stops_at_the_next_denoising_step_past_its_deadline(tiny_sd_path):
    engine = threadless(tiny_sd_path, mode="request")
    try:
        seen = []
        steps = {"n": 0}

        def expire_at_step_2(module, args):
            steps["n"] += 1
            if steps["n"] == 2:
                engine.scheduler.get_request_state("w").deadline = 0.0
        handle = runner(engine).adapter.denoiser.register_forward_pre_hook(expire_at_step_2)
        try:
            stream = engine.add_request(make_request("w", num_inference_steps=10, seed=1))
            engine.step()
        finally:
            handle.remove()
        out = stream.get(timeout=0)
        seen.append(steps["n"])
        assert out.error_type == "deadline_exceeded" and seen == [2]      # no third denoiser call
        assert_nothing_left(engine)
    finally:
        engine.close()
