"""The exact-hit result cache (stage_runtime/engine/result_cache.py): a repeat of a request identical in
every pixel-affecting field returns the same bytes without running, in a fraction of the first one's time;
requests without an explicit seed are never served from it; the LRU never exceeds its byte bound."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.engine.result_cache import ResultCache, result_key
from stage_runtime.imageio import encode_png
from stage_runtime.request import DiffusionRequest, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_dit_path):
    config = load_config({"model": {"path": tiny_dit_path}, "device": "cpu", "warmup": False,
                          "cache": {"result_max_bytes": 1 << 20}})
    eng = DiffusionEngine.make_engine(config)
    yield eng
    eng.close()


def run(engine, rid: str, **sampling):
    return engine.add_request(DiffusionRequest(rid, "7", SamplingParams(**sampling))).result(timeout=120)


def test_an_exact_repeat_returns_the_same_bytes_in_under_5_percent_of_the_time(engine):
    started = time.perf_counter()
    first = run(engine, "first", seed=11, num_inference_steps=10)
    first_s = time.perf_counter() - started
    started = time.perf_counter()
    repeat = run(engine, "repeat", seed=11, num_inference_steps=10)
    repeat_s = time.perf_counter() - started
    assert encode_png(repeat.images[0]) == encode_png(first.images[0])
    assert repeat.metrics["result_cache_hit"] == 1 and "result_cache_hit" not in first.metrics
    assert repeat_s < 0.05 * first_s, (repeat_s, first_s)
    assert engine.result_cache.num_expected() == 0


def test_no_seed_another_field_or_a_stream_is_never_a_hit(engine):
    hits = engine.result_cache.hits
    run(engine, "a", num_inference_steps=2)
    run(engine, "b", num_inference_steps=2)                         # no seed: a new random image each time
    run(engine, "c", seed=12, num_inference_steps=2)
    run(engine, "d", seed=12, num_inference_steps=3)                # another step count
    run(engine, "e", seed=12, num_inference_steps=2, guidance_scale=1.0)
    run(engine, "f", seed=12, num_inference_steps=2, cache="off")   # another cache policy
    run(engine, "g", seed=12, num_inference_steps=2, stream=True)   # a stream wants its progress
    assert engine.result_cache.hits == hits
    run(engine, "h", seed=12, num_inference_steps=2)
    assert engine.result_cache.hits == hits + 1
    assert engine.num_request_states() == 0 and engine.result_cache.num_expected() == 0


def test_the_key_takes_every_pixel_field_the_reference_picture_and_the_adapters():
    def key(prompt="x", loras=(), digests=None, revision="r", reference=None, **sampling):
        request = DiffusionRequest("id", prompt, SamplingParams(**{"seed": 1, "loras": loras, **sampling}),
                                   reference=reference)
        if digests is not None:
            request.lora_digests = digests     # recorded at admission: the file loaded under the name
        return result_key(request, revision)

    base = key()
    variants = [key(prompt="y"), key(seed=2), key(negative_prompt="n"), key(height=64), key(num_inference_steps=3),
                key(guidance_scale=2.0), key(negative_prompt="n", true_cfg_scale=4.0), key(num_outputs=2), key(cache={"threshold": 0.1}), key(revision="r2"),
                key(loras=[{"name": "ink", "scale": 0.5}]), key(loras=[{"name": "ink", "scale": 1.0}]),
                key(loras=[{"name": "ink", "scale": 1.0}], digests=("0123456789abcdef",)),
                key(num_frames=9), key(fps=12), key(guidance_scale_2=3.0),      # a video's own fields
                key(reference=np.zeros((4, 4, 3), np.uint8)), key(reference=np.ones((4, 4, 3), np.uint8))]
    assert len({base, *variants}) == len(variants) + 1
    assert key(priority=5, timeout_s=3) == base                      # scheduling fields change no pixel
    assert result_key(DiffusionRequest("id", "x", SamplingParams()), "r") is None


def test_the_lru_never_exceeds_its_bound_and_evicts_the_least_recently_used():
    rng = random.Random(0)
    cache = ResultCache(max_bytes=10_000)
    for i in range(300):
        cache.put(f"k{rng.randrange(40)}", np.zeros(rng.randrange(1, 4000), np.uint8))
        assert cache.nbytes <= cache.max_bytes
        assert cache.nbytes == sum(v.nbytes for v in cache._entries.values())
    assert not cache.put("huge", np.zeros(10_001, np.uint8)) and "huge" not in cache._entries
    small = ResultCache(max_bytes=300)
    for name in "abc":
        small.put(name, np.zeros(100, np.uint8))
    small._entries.move_to_end("a")                                   # "a" used: "b" is now the oldest
    small.put("d", np.zeros(100, np.uint8))
    assert list(small._entries) == ["c", "a", "d"] and small.evictions == 1
