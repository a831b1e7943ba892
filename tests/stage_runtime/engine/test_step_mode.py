"""Step mode on the real tiny pipelines: reference equality with diffusers ``__call__``, continuous
batching, streaming progress and previews, step-granular abort with state release."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from engine_probes import (assert_no_state, count_at_delivery, count_denoiser_calls, max_diff, phased, progress_of,
                           runner_of, wait_until)

from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.errors import InvalidRequestError, RequestAbortedError, RequestFailedError
from stage_runtime.request import DiffusionRequest, SamplingParams


def make_engine(path: str, adapter: str | None = None, **scheduler) -> DiffusionEngine:
    scheduler.setdefault("execution_mode", "step")
    config = load_config({"model": {"path": path, "adapter": adapter}, "device": "cpu", "scheduler": scheduler})
    return DiffusionEngine.make_engine(config)


def req(rid: str, prompt: str, steps: int, seed: int, **kw) -> DiffusionRequest:
    return DiffusionRequest(rid, prompt, SamplingParams(num_inference_steps=steps, seed=seed, **kw))


def call_reference(path: str, prompt: str, steps: int, seed: int, n: int = 1, guidance: float | None = None):
    """The bare diffusers pipeline's __call__, one generator per image (seed + i)."""
    pipe = DiffusionPipeline.from_pretrained(path, local_files_only=True, low_cpu_mem_usage=False)
    pipe.set_progress_bar_config(disable=True)
    gens = [torch.Generator("cpu").manual_seed(seed + i) for i in range(n)]
    if type(pipe).__name__ == "DiTPipeline":
        images = pipe(class_labels=[int(prompt)] * n, guidance_scale=guidance or 4.0, generator=gens,
                      num_inference_steps=steps, output_type="np").images
    else:
        images = pipe(prompt=[prompt] * n, negative_prompt=[""] * n, guidance_scale=guidance or 7.5,
                      num_inference_steps=steps, generator=gens, output_type="np").images
    return (images * 255).round().clip(0, 255).astype(np.uint8)


@pytest.fixture(params=["sd", "dit"])
def model(request, tiny_sd_path, tiny_dit_path):
    return {"sd": (tiny_sd_path, "a red fox"), "dit": (tiny_dit_path, "207")}[request.param]


def test_step_mode_equals_diffusers_call_alone_and_batched(model):
    path, prompt = model
    ref = call_reference(path, prompt, steps=6, seed=11, n=2)
    eng = make_engine(path, max_num_seqs=4)
    try:
        alone = eng.add_request(req("alone", prompt, 6, 11, num_outputs=2)).result(timeout=60)
        assert max_diff(alone.images, ref) <= 2
        # batched with requests of different step counts that join and leave around it
        other_prompt = "a blue car" if prompt != "207" else "13"
        long = eng.add_request(req("long", other_prompt, 12, 5))
        mid = eng.add_request(req("target", prompt, 6, 11, num_outputs=2))
        short = eng.add_request(req("short", other_prompt, 3, 6))
        batched = mid.result(timeout=60)
        assert max_diff(batched.images, ref) <= 2
        assert max_diff(long.result(timeout=60).images, call_reference(path, other_prompt, 12, 5)) <= 2
        assert max_diff(short.result(timeout=60).images, call_reference(path, other_prompt, 3, 6)) <= 2
        assert_no_state(eng)
    finally:
        eng.close()


def test_continuous_batching_short_request_joins_next_tick_and_finishes_first(tiny_sd_path):
    eng = make_engine(tiny_sd_path, max_num_seqs=2)
    try:
        long = eng.add_request(req("long", "a lighthouse", 20, 1, stream=True))
        progress = []
        while True:
            item = long.get(timeout=30)
            progress.append(item.step_index)
            if item.step_index >= 3:
                break
        short = eng.add_request(req("short", "a boat", 4, 2, stream=True))
        assert short.get(timeout=30).phase == "encode"     # the short request's first tick ...
        first = short.get(timeout=30)                      # ... ends with its step 1
        long_step_at_join = eng.scheduler.get_request_state("long").step_index
        assert (first.phase, first.step_index) == ("denoise", 1) and not first.finished
        assert long_step_at_join <= progress[-1] + 2       # joined at the next tick boundary
        short_out = short.result(timeout=30)
        assert not long.finished                           # the short one finished first
        long_items = list(long)
        assert long_items[-1].finished and long_items[-1].step_index == 20
        solo_long = eng.add_request(req("solo-long", "a lighthouse", 20, 1)).result(timeout=60)
        solo_short = eng.add_request(req("solo-short", "a boat", 4, 2)).result(timeout=60)
        assert max_diff(long_items[-1].images, solo_long.images) <= 2
        assert max_diff(short_out.images, solo_short.images) <= 2
        assert_no_state(eng)
    finally:
        eng.close()


def test_streaming_yields_every_step_in_order_then_one_final_image(tiny_sd_path):
    eng = make_engine(tiny_sd_path, streaming_output=True, max_num_seqs=2)
    try:
        items = list(eng.add_request(req("s", "a cat", 6, 3, preview_every=2)))
        assert progress_of(items) == phased(6) and items[-1].step_index == 6
        previews = [i.step_index for i in items[:-1] if i.images is not None]
        assert previews == [2, 4]                              # decoded previews every 2 steps
        assert items[2].images.shape == (1, 64, 64, 3) and items[-1].images.shape == (1, 64, 64, 3)
        assert sum(i.finished for i in items) == 1
    finally:
        eng.close()


def test_request_mode_streams_progress_from_the_step_hook(tiny_sd_path):
    eng = make_engine(tiny_sd_path, execution_mode="request")
    try:
        items = list(eng.add_request(req("s", "a cat", 5, 3, stream=True)))
        assert progress_of(items) == phased(5) and items[-1].step_index == 5 and items[-1].ok
        with pytest.raises(InvalidRequestError, match="preview_every.*execution_mode=step"):
            eng.add_request(req("p", "a cat", 5, 3, preview_every=2))
    finally:
        eng.close()


def _shm_segments() -> set[str]:
    """This process's segments (the executor names them ``ds-<engine pid>-…``): other test processes share /dev/shm."""
    ours = f"ds-{os.getpid()}-"
    return {s for s in os.listdir("/dev/shm") if s.startswith(ours)} if os.path.isdir("/dev/shm") else set()


def test_abort_at_random_steps_for_50_requests(tiny_dit_path):
    eng = make_engine(tiny_dit_path, max_num_seqs=4)
    calls = count_denoiser_calls(eng)
    shm_before = _shm_segments()
    rng = random.Random(1234)
    mate = eng.add_request(req("mate", "13", 900, 99))        # a batch-mate that keeps running throughout
    try:
        for i in range(50):
            target = rng.randint(0, 8)
            stream = eng.add_request(req(f"r{i}", str(i), 12, i, stream=True))
            while target and stream.get(timeout=30).step_index < target:
                pass
            delivered = count_at_delivery(stream, calls)
            at_abort = calls[0]
            assert eng.abort(f"r{i}") == [f"r{i}"]
            with pytest.raises(RequestAbortedError):
                stream.result(timeout=30)
            ticks = delivered[0] - at_abort
            assert ticks <= 1, f"request {i} ended {ticks} ticks after its abort"
        assert not mate.finished                                # batch-mate unaffected
        wait_until(lambda: set(runner_of(eng).step_states) == {"mate"})
        eng.abort("mate")
        with pytest.raises(RequestAbortedError):
            mate.result(timeout=30)
        assert_no_state(eng)
        assert eng.counters["aborted_total"] == 51
        assert _shm_segments() <= shm_before
    finally:
        eng.close()


def test_abort_of_the_only_request_frees_runner_state_without_new_work(tiny_sd_path):
    eng = make_engine(tiny_sd_path)
    try:
        stream = eng.add_request(req("only", "a cat", 500, 1, stream=True))
        stream.get(timeout=30)
        eng.abort("only")
        with pytest.raises(RequestAbortedError):
            stream.result(timeout=30)
        assert_no_state(eng)          # retired by an empty tick, not by the next request
    finally:
        eng.close()


def test_step_failures_stay_per_request(tiny_sd_path):
    eng = make_engine(tiny_sd_path, adapter="adapters_for_tests:StepFaultSDAdapter", max_num_seqs=4)
    try:
        mate = eng.add_request(req("mate", "a cat", 6, 1))
        boom = eng.add_request(req("boom", "boom", 6, 2))
        late = eng.add_request(req("late", "late-boom", 6, 3))
        with pytest.raises(RequestFailedError, match="boom in prepare_encode"):
            boom.result(timeout=60)
        with pytest.raises(RequestFailedError, match="boom in step 3"):
            late.result(timeout=60)
        solo = eng.add_request(req("solo", "a cat", 6, 1)).result(timeout=60)
        assert max_diff(mate.result(timeout=60).images, solo.images) <= 2
        assert eng.counters["failed_total"] == 2 and eng.state == "ready"
        assert_no_state(eng)
    finally:
        eng.close()
