"""The prompt-embedding cache (stage_runtime/models/prompt_cache.py) over a real pipeline's encode_prompt:
a repeated prompt is encoded once and gives the bitwise-same image (request and step mode), and the video families'
(Wan, LTX-2, HunyuanVideo-1.5) the bitwise-same frames as a stage without the cache; adapters (where a text encoder
is adapted) and every call argument are in the key; the LRU never exceeds its byte bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_probes import runner_of
from family_checks import Family
from lora_probes import write_adapter

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


VIDEO = {"wan": Family("wan", size=16, frames=9), "wan22": Family("wan22", size=16, frames=9),
         "ltx2": Family("ltx2", size=64, frames=9), "hunyuan-video15": Family("hunyuan-video15", size=16, frames=9)}
ENCODES = {"hunyuan-video15": 2}      # encode_prompt calls per request: HunyuanVideo-1.5 encodes the negative apart


@pytest.mark.parametrize("mode", ["request", "step"])
@pytest.mark.parametrize("kind", list(VIDEO))
def test_a_repeated_video_prompt_hits_and_gives_the_uncached_frames(tiny_model, kind, mode):
    """Wan (T5), LTX-2 (Gemma; its connectors run after the cached encode) and HunyuanVideo-1.5 (two encoders, one
    call for the prompt and one for the negative prompt): the hit's frames are bitwise those of a stage without the
    cache."""
    row, frames = VIDEO[kind], {}
    for bound in (0, 1 << 24):
        config = load_config({"model": {"path": tiny_model(kind)}, "device": "cpu", "warmup": False,
                              "cache": {"prompt_max_bytes": bound}, "scheduler": {"execution_mode": mode}})
        engine = DiffusionEngine(config)                  # threadless: step() runs it
        try:
            for rid in ("first", "again"):
                stream = engine.add_request(row.request(rid, "a red fox", 2, 4, negative_prompt="blurry"))
                while not stream.finished:
                    engine.step()
                frames[(bound, rid)] = stream.result(timeout=1).images
            cache = runner_of(engine).prompt_cache
            if bound:
                calls = ENCODES.get(kind, 1)
                assert (cache.misses, cache.hits, len(cache)) == (calls, calls, calls)
            else:
                assert cache is None
        finally:
            engine.close()
    uncached = frames[(0, "first")]
    assert uncached.shape == (1, 9, row.size, row.size, 3)
    assert all(np.array_equal(video, uncached) for video in frames.values())


def test_a_wan_request_with_an_adapter_reuses_the_plain_prompts_embeddings(tiny_wan_path, tmp_path):
    """Wan's adapters touch only its experts (T5 is never adapted), so the adapters are not in the key there."""
    lora = write_adapter(tiny_wan_path, tmp_path / "fast", seed=1, text_encoder=False, gain=1.0)
    config = load_config({"model": {"path": tiny_wan_path}, "device": "cpu", "warmup": False,
                          "loras": [{"name": "fast", "path": lora}], "cache": {"prompt_max_bytes": 1 << 24},
                          "scheduler": {"execution_mode": "step"}})
    engine = DiffusionEngine(config)
    try:
        row, videos = VIDEO["wan"], []
        for rid, loras in (("plain", []), ("adapted", [{"name": "fast", "scale": 1.0}])):
            stream = engine.add_request(row.request(rid, "a red fox", 2, 4, loras=loras))
            while not stream.finished:
                engine.step()
            videos.append(stream.result(timeout=1).images)
        cache = runner_of(engine).prompt_cache
        assert (cache.misses, cache.hits) == (1, 1)
        assert not np.array_equal(videos[0], videos[1])              # the adapter ran on the transformer
    finally:
        engine.close()
