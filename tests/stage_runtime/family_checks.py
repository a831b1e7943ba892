"""The acceptance checks every first-class family passes through the real engine (in-process executor):
equal to the bare diffusers call, different step counts batched in step mode, abort at a random step,
progress in order. test_sd3.py / test_flux.py run them on their tiny pipeline."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from engine_probes import assert_no_state, count_denoiser_calls, max_diff

from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.errors import RequestAbortedError
from stage_runtime.request import DiffusionRequest, SamplingParams

SIZE = 64


def make_engine(path: str, **scheduler) -> DiffusionEngine:
    config = load_config({"model": {"path": path}, "device": "cpu", "warmup": False, "scheduler": scheduler})
    return DiffusionEngine.make_engine(config)


def req(rid: str, prompt: str, steps: int, seed: int, **kw) -> DiffusionRequest:
    return DiffusionRequest(rid, prompt, SamplingParams(num_inference_steps=steps, seed=seed, height=SIZE,
                                                        width=SIZE, **kw))


class BareCall:
    """The pipeline's own ``__call__`` (one generator per image, seed + i), loaded once."""

    def __init__(self, path: str):
        self.pipe = DiffusionPipeline.from_pretrained(path, local_files_only=True, low_cpu_mem_usage=False)
        self.pipe.set_progress_bar_config(disable=True)

    def __call__(self, prompt: str, steps: int, seed: int, guidance: float, n: int = 1, **kw) -> np.ndarray:
        gens = [torch.Generator("cpu").manual_seed(seed + i) for i in range(n)]
        images = self.pipe(prompt=[prompt] * n, height=SIZE, width=SIZE, num_inference_steps=steps,
                           guidance_scale=guidance, generator=gens, output_type="np", **kw).images
        return (images * 255).round().clip(0, 255).astype(np.uint8)


def check_request_mode(path: str, bare: BareCall, guidance: float, **call_kw) -> None:
    """Two requests fused into one call (n=1 and n=2) each equal their bare call within 1 uint8."""
    eng = make_engine(path, execution_mode="request", max_num_seqs=2, request_batch_max_wait_ms=200)
    calls = count_denoiser_calls(eng)
    try:
        a = eng.add_request(req("a", "a photo of a cat", 3, 1))
        b = eng.add_request(req("b", "a red car", 3, 2, num_outputs=2))
        out_a, out_b = a.result(timeout=60), b.result(timeout=60)
        assert calls[0] == 3, f"{calls[0]} denoiser forwards for two 3-step requests: they were not fused"
        assert max_diff(out_a.images, bare("a photo of a cat", 3, 1, guidance, **call_kw)) <= 1
        assert max_diff(out_b.images, bare("a red car", 3, 2, guidance, n=2, **call_kw)) <= 1
        assert out_a.images.std() > 10 and max_diff(out_a.images, out_b.images[:1]) > 50
        assert_no_state(eng)
    finally:
        eng.close()


def check_step_mode_batches_different_step_counts(path: str, bare: BareCall, guidances: tuple[float, float],
                                                  **call_kw) -> None:
    """Requests of different step counts (and guidance) share ticks; each equals its bare call within 2."""
    eng = make_engine(path, execution_mode="step", max_num_seqs=4)
    calls = count_denoiser_calls(eng)
    try:
        g1, g2 = guidances
        long = eng.add_request(req("long", "a photo of a cat", 6, 3, guidance_scale=g1))
        short = eng.add_request(req("short", "a red car", 3, 4, num_outputs=2, guidance_scale=g2))
        long_out, short_out = long.result(timeout=60), short.result(timeout=60)
        assert calls[0] == 6, f"{calls[0]} denoiser forwards for 6 + 3 steps: the requests did not share ticks"
        assert max_diff(long_out.images, bare("a photo of a cat", 6, 3, g1, **call_kw)) <= 2
        assert max_diff(short_out.images, bare("a red car", 3, 4, g2, n=2, **call_kw)) <= 2
        assert_no_state(eng)
    finally:
        eng.close()


def check_abort_at_random_steps(path: str, rounds: int = 6) -> None:
    """Abort at a random step, next to a running batch-mate: the stream ends aborted, all state is released."""
    eng = make_engine(path, execution_mode="step", max_num_seqs=2)
    rng = random.Random(14)
    mate = eng.add_request(req("mate", "a tree", 400, 9))
    try:
        for i in range(rounds):
            target = rng.randint(1, 5)
            stream = eng.add_request(req(f"r{i}", "a dog", 8, i, stream=True))
            while stream.get(timeout=30).step_index < target:
                pass
            assert eng.abort(f"r{i}") == [f"r{i}"]
            with pytest.raises(RequestAbortedError):
                stream.result(timeout=30)
        assert not mate.finished
        eng.abort("mate")
        with pytest.raises(RequestAbortedError):
            mate.result(timeout=30)
        assert_no_state(eng)
        assert eng.counters["aborted_total"] == rounds + 1
    finally:
        eng.close()


def check_progress_in_order(path: str) -> None:
    """A streamed request reports every step in order, previews where asked, then one final image."""
    eng = make_engine(path, execution_mode="step", max_num_seqs=2, streaming_output=True)
    try:
        items = list(eng.add_request(req("s", "a cat", 4, 3, preview_every=2)))
        assert [i.step_index for i in items] == [1, 2, 3, 4]
        assert [i.finished for i in items] == [False, False, False, True]
        assert [i.step_index for i in items[:-1] if i.images is not None] == [2]
        assert items[-1].images.shape == (1, SIZE, SIZE, 3)
    finally:
        eng.close()
