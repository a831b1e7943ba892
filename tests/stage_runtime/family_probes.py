"""Checks every model family's tests share: the engine around a tiny family model, the bare diffusers
call it must equal, and the step-mode / abort / progress contracts (they observe; they replace nothing)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from engine_probes import assert_no_state, max_diff, runner_of

from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.errors import RequestAbortedError
from stage_runtime.request import DiffusionRequest, SamplingParams

_PIPES: dict[str, DiffusionPipeline] = {}


def make_engine(path: str, mode: str = "request", adapter: str | None = None, warmup: bool = True,
                **scheduler) -> DiffusionEngine:
    config = load_config({"model": {"path": path, "adapter": adapter}, "device": "cpu", "warmup": warmup,
                          "scheduler": {"execution_mode": mode, **scheduler}})
    return DiffusionEngine.make_engine(config)


def req(rid: str, prompt: str, steps: int, seed: int, **kw) -> DiffusionRequest:
    return DiffusionRequest(rid, prompt, SamplingParams(num_inference_steps=steps, seed=seed, **kw))


def bare_pipeline(path: str) -> DiffusionPipeline:
    """The folder loaded by diffusers alone (cached per path: loading is the slow part)."""
    if path not in _PIPES:
        pipe = DiffusionPipeline.from_pretrained(path, local_files_only=True, low_cpu_mem_usage=False)
        pipe.set_progress_bar_config(disable=True)
        _PIPES[path] = pipe
    return _PIPES[path]


def to_uint8(images) -> np.ndarray:
    return (np.asarray(images) * 255).round().clip(0, 255).astype(np.uint8)


def generators(seed: int, n: int) -> list[torch.Generator]:
    return [torch.Generator("cpu").manual_seed(seed + i) for i in range(n)]


def check_different_step_counts_share_ticks(engine, solo, prompts: tuple[str, str], **kw) -> None:
    """Step mode: a long and a short request batched together each equal their solo runs (<= 2 uint8), and
    they shared denoiser calls (fewer forwards than 7 + 3)."""
    calls = [0]
    handle = runner_of(engine).adapter.denoiser.register_forward_pre_hook(
        lambda _m, _a: calls.__setitem__(0, calls[0] + 1))
    try:
        long = engine.add_request(req("long", prompts[0], 7, 5, **kw))
        short = engine.add_request(req("short", prompts[1], 3, 6, **kw))
        short_images, long_images = short.result(timeout=120).images, long.result(timeout=120).images
    finally:
        handle.remove()
    assert calls[0] < 10, f"{calls[0]} denoiser calls: the two requests never shared a tick"
    assert max_diff(short_images, solo(prompts[1], 3, 6)) <= 2
    assert max_diff(long_images, solo(prompts[0], 7, 5)) <= 2
    assert_no_state(engine)


def check_progress_in_order(engine, prompt: str, steps: int = 5, **kw) -> None:
    items = list(engine.add_request(req("progress", prompt, steps, 3, stream=True, **kw)))
    assert [i.step_index for i in items] == list(range(1, steps + 1))
    assert [i.finished for i in items] == [False] * (steps - 1) + [True] and items[-1].ok


def check_abort_at_random_steps(engine, prompt: str, rounds: int = 4, steps: int = 8, seed: int = 7, **kw) -> None:
    """Abort each request at a random step: it ends aborted within a step and nothing is left anywhere."""
    rng = random.Random(seed)
    for i in range(rounds):
        target = rng.randint(1, steps - 2)
        stream = engine.add_request(req(f"abort{i}", prompt, steps, i, stream=True, **kw))
        while stream.get(timeout=60).step_index < target:
            pass
        assert engine.abort(f"abort{i}") == [f"abort{i}"]
        with pytest.raises(RequestAbortedError):
            stream.result(timeout=60)
        assert_no_state(engine)
    assert runner_of(engine).num_request_states() == 0
