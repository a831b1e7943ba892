"""A long video yields to a short request at the next step boundary and resumes to the identical result: the tiny
Wan 2.2 (two experts, UniPC's multistep state kept per request), the engine driven by ``step()`` (one tick each),
with the priority and srpt policies, the video's state kept in place or copied to host memory while it waits."""

from __future__ import annotations

import numpy as np
import pytest
from family_checks import Family
from engine_probes import assert_nothing_left, runner_of, threadless

from stage_runtime.request import RequestStatus

WAN22 = Family("wan22", size=16, frames=9)
LONG_STEPS = 12


@pytest.fixture(scope="module")
def solo_video(tiny_wan22_path) -> np.ndarray:
    """The long video alone, uninterrupted, step mode: what every preempted and resumed run must equal bitwise."""
    engine = threadless(tiny_wan22_path)
    try:
        stream = engine.add_request(WAN22.request("L", "a red car", LONG_STEPS, 7, guidance_scale_2=3.0))
        while not stream.finished:
            engine.step()
        return stream.result(timeout=0).images
    finally:
        engine.close()


@pytest.mark.parametrize(("policy", "offload"), [("priority", 0), ("priority", 1 << 30), ("srpt", 0)],
                         ids=["priority-kept-in-place", "priority-offloaded-to-host", "srpt"])
def test_a_one_frame_request_preempts_a_long_video_at_the_next_step_and_the_video_resumes_bitwise(
        tiny_wan22_path, solo_video, policy, offload):
    engine = threadless(tiny_wan22_path, scheduling_policy=policy, max_preemptions=3,
                        preempted_offload_max_bytes=offload)
    try:
        long = engine.add_request(WAN22.request("L", "a red car", LONG_STEPS, 7, guidance_scale_2=3.0))
        for _ in range(5):
            engine.step()
        short = engine.add_request(WAN22.request("S", "a cat", 3, 3, num_frames=1, priority=10))
        engine.step()                                 # the next boundary: the video waits, S takes its first step
        assert engine.scheduler.get_request_state("S").step_index == 1
        video = engine.scheduler.get_request_state("L")
        assert video.status == RequestStatus.PREEMPTED and video.step_index == 5 and set(runner_of(engine).parked) == {"L"}
        while not short.finished:
            engine.step()
        assert short.result(timeout=0).images.shape == (1, 1, 16, 16, 3) and not long.finished
        while not long.finished:
            engine.step()
        out = long.result(timeout=0)
        assert out.step_index == LONG_STEPS and out.metrics["preemptions"] == 1
        assert np.array_equal(out.images, solo_video)          # bitwise: the same steps from the same state
        assert_nothing_left(engine)
    finally:
        engine.close()
