"""The prompt-embedding cache (stage_runtime/models/prompt_cache.py) over a real pipeline's encode_prompt:
a repeated prompt is encoded once and gives the bitwise-same image (request and step mode); adapters and
every call argument are in the key; the LRU never exceeds its byte bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_probes import runner_of

from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.models.prompt_cache import PromptEmbeddingCache
from stage_runtime.request import DiffusionRequest, SamplingParams


@pytest.mark.parametrize("mode", ["request", "step"])
def test_a_repeated_prompt_is_encoded_once_and_gives_the_same_image(tiny_sd_path, mode):
    config = load_config({"model": {"path": tiny_sd_path}, "device": "cpu", "warmup": False,
                          "cache": {"prompt_max_bytes": 1 << 20}, "scheduler": {"execution_mode": mode}})
    engine = DiffusionEngine.make_engine(config)
    try:
        cache = runner_of(engine).prompt_cache
        run = [engine.add_request(DiffusionRequest(f"r{i}", "a red cat", SamplingParams(num_inference_steps=3, seed=4)))
               .result(timeout=120).images for i in range(2)]
        assert (cache.misses, cache.hits) == (1, 1)
        assert np.array_equal(run[0], run[1])
        engine.add_request(DiffusionRequest("other", "a blue cat", SamplingParams(num_inference_steps=3, seed=4))
                           ).result(timeout=120)
        assert (cache.misses, cache.hits, len(cache)) == (2, 1, 2)
    finally:
        engine.close()


def test_the_key_has_the_adapters_and_arguments_and_hits_are_copies():
    cache = PromptEmbeddingCache(max_bytes=1 << 20, encoder_id="enc")
    calls = []

    def encode(prompt, num_images_per_prompt=1, lora_scale=None):
        calls.append(prompt)
        return torch.ones(num_images_per_prompt, 4), None

    cached = cache.wrap(encode)
    first, _ = cached(["a"], num_images_per_prompt=1)
    first.mul_(0)                                          # a caller changing its tensor changes no entry
    assert torch.equal(cached(["a"], num_images_per_prompt=1)[0], torch.ones(1, 4))
    cached(["a"], num_images_per_prompt=2)
    with cache.adapters((("ink", 0.5),)):
        cached(["a"], num_images_per_prompt=1)
    cached(["a"], num_images_per_prompt=1, lora_scale=0.5)
    assert len(calls) == 4 and cache.hits == 1
    assert cache.key((torch.ones(1),), {}) is None         # precomputed tensors: never cached


def test_the_lru_never_exceeds_its_bound():
    cache = PromptEmbeddingCache(max_bytes=1000)
    for i in range(50):
        cache.put(f"k{i % 7}", (torch.zeros(i % 9 + 1, 16),))      # 64 .. 576 bytes
        assert cache.nbytes <= 1000 and cache.nbytes == sum(size for _, size in cache._entries.values())
    assert not cache.put("big", (torch.zeros(300),))                   # 1200 bytes: never stored
