"""A quantized model through the real engine equals the bare diffusers pipeline quantized the same way (the same
function over the same folder), as every model path must: request mode within 1 (uint8), step mode within 2, for
int8-weight and fp8-storage on the tiny SD; and the mechanisms on a quantized base — the block cache skipping on an
int8 DiT, Ulysses over two gloo ranks within 2 of one int8 rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from family_checks import Family, generators, prompt_call, to_uint8

from stage_runtime.config import ModelConfig, load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.models.registry import resolve_adapter_class
from stage_runtime.quantization import quantize
from stage_runtime.request import DiffusionRequest, RequestCache, SamplingParams

SD = Family("sd")
STEPS, SEED, GUIDANCE = 4, 5, 7.5


def engine(path: str, method: str, mode: str, **extra) -> DiffusionEngine:
    return DiffusionEngine.make_engine(load_config({
        "model": {"path": path}, "device": "cpu", "warmup": False, "quantization": {"method": method},
        "scheduler": {"execution_mode": mode, "max_num_seqs": 4}, **extra}))


def bare_quantized(path: str, method: str, prompt: str, n: int) -> np.ndarray:
    adapter = resolve_adapter_class(ModelConfig(path=path)).load(path, torch.device("cpu"))
    quantize(adapter, load_config({"model": {"path": path}, "quantization": {"method": method}}), torch.device("cpu"))
    adapter.pipe.set_progress_bar_config(disable=True)
    out = adapter.pipe(**prompt_call(adapter.pipe, prompt, n, GUIDANCE), height=SD.size, width=SD.size,
                       num_inference_steps=STEPS, generator=generators(SEED, n), output_type="np")
    return to_uint8(out.images)


@pytest.mark.parametrize("method", ["int8-weight", "fp8-storage"])
@pytest.mark.parametrize("mode, tolerance", [("request", 1), ("step", 2)])
def test_a_quantized_engine_equals_the_bare_pipeline_quantized_alike(method, mode, tolerance, tiny_sd_path):
    eng = engine(tiny_sd_path, method, mode)
    try:
        streams = {n: eng.add_request(SD.request(f"r{n}", f"a cat {n}", STEPS, SEED, num_outputs=n,
                                                 guidance_scale=GUIDANCE)) for n in (1, 2)}
        got = {n: s.result(timeout=120).images for n, s in streams.items()}
    finally:
        eng.close()
    for n, images in got.items():
        bare = bare_quantized(tiny_sd_path, method, f"a cat {n}", n)
        assert np.abs(images.astype(int) - bare.astype(int)).max() <= tolerance, (method, mode, n)


def digits(eng: DiffusionEngine, **sampling) -> dict:
    streams = {i: eng.add_request(DiffusionRequest(f"d{i}", str(i), SamplingParams(num_inference_steps=10, seed=i,
                                                                                  **sampling))) for i in range(3)}
    return {i: s.result(timeout=300) for i, s in streams.items()}


def test_the_block_cache_skips_on_an_int8_base(tiny_digits_path):
    eng = engine(tiny_digits_path, "int8-weight", "step")
    try:
        out = digits(eng, cache=RequestCache(threshold=1.0))
    finally:
        eng.close()
    assert all(o.metrics.get("steps_skipped", 0) > 0 for o in out.values()), [o.metrics for o in out.values()]


def test_ulysses_on_an_int8_base_equals_one_int8_rank(tiny_digits_path):
    one = engine(tiny_digits_path, "int8-weight", "step")
    two = engine(tiny_digits_path, "int8-weight", "step", executor="mp", parallel={"ulysses_degree": 2},
                 collective_timeout_s=300)
    try:
        single, sharded = digits(one), digits(two)
    finally:
        one.close()
        two.close()
    for i in single:
        assert np.abs(single[i].images.astype(int) - sharded[i].images.astype(int)).max() <= 2, i
