"""A quantized model through the real engine equals the bare diffusers pipeline quantized the same way (the same
function over the same folder), as every model path must: request mode within 1 (uint8), step mode within 2, for
int8-weight and fp8-storage on the tiny SD; and the mechanisms on a quantized base — the block cache skipping on an
int8 DiT, Ulysses over two gloo ranks within 2 of one int8 rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from family_checks import Family, generators, prompt_call, to_uint8

from stage_runtime.config import ConfigError, ModelConfig, load_config
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
    """The bare pipeline quantized by the same function."""
    adapter = resolve_adapter_class(ModelConfig(path=path)).load(path, torch.device("cpu"))
    quantize(adapter, load_config({"model": {"path": path}, "quantization": {"method": method}}), torch.device("cpu"))
    return run_bare(adapter.pipe, prompt, n)


def run_bare(pipe, prompt: str, n: int) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    out = pipe(**prompt_call(pipe, prompt, n, GUIDANCE), height=SD.size, width=SD.size,
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


def float8_rounded_with_lora(path: str, lora: str):
    """The bare pipeline whose UNet holds exactly what fp8-storage stores (each weight it casts, rounded to float8 and
    back, in plain float32 tensors), with diffusers' own LoRA loaded over it."""
    stored = resolve_adapter_class(ModelConfig(path=path)).load(path, torch.device("cpu"))
    quantize(stored, load_config({"model": {"path": path}, "quantization": {"method": "fp8-storage"}}),
             torch.device("cpu"))
    pipe = resolve_adapter_class(ModelConfig(path=path)).load(path, torch.device("cpu")).pipe
    rounded = 0
    with torch.no_grad():
        for name, param in pipe.unet.named_parameters():
            kept = stored.pipe.unet.get_parameter(name)
            if kept.dtype == torch.float8_e4m3fn:
                param.copy_(kept.to(torch.float32))
                rounded += 1
    assert rounded > 10, rounded
    pipe.load_lora_weights(lora, adapter_name="ink")
    return pipe


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


def test_model_offload_of_the_unquantized_components_on_an_int8_unet(tiny_sd_path):
    """The text encoder and the VAE offloaded (model mode), the int8 UNet resident: equal to the bare int8 pipeline
    within 1, and the offloaded components released to the host after the request."""
    eng = engine(tiny_sd_path, "int8-weight", "request",
                 offload={"mode": "model", "components": ["text_encoder", "vae"]})
    try:
        got = eng.add_request(SD.request("o", "a cat 1", STEPS, SEED, guidance_scale=GUIDANCE)).result(timeout=120)
        (offload,) = eng.collective_rpc("offload_stats")
        (weights,) = eng.weights
    finally:
        eng.close()
    assert np.abs(got.images.astype(int) - bare_quantized(tiny_sd_path, "int8-weight", "a cat 1", 1)).max() <= 1
    assert weights["components"]["unet"]["method"] == "int8-weight", weights
    offloaded = weights["components"]["text_encoder"]["bytes"] + weights["components"]["vae"]["bytes"]
    assert offload["loads"] > 0 and offload["managed_bytes"] == offloaded, (offload, weights)
    assert offload["resident_bytes"]["cpu"] == 0, offload                # released after the request


def test_offloading_the_quantized_denoiser_is_refused_at_load_naming_it(tiny_sd_path):
    with pytest.raises(ConfigError) as info:
        engine(tiny_sd_path, "int8-weight", "request", offload={"mode": "model", "components": ["unet", "vae"]})
    assert "offload.components lists unet, quantized with method='int8-weight'" in str(info.value)


def test_regional_compile_over_int8_weights_recompiles_nothing_and_equals_the_uncompiled_int8_engine(
        tiny_digits_path):
    """The compiled blocks run torchao's int8 linears inside their graphs: warmed before ready, no recompile after,
    the digits within 1 of the same int8 engine without compile."""
    from support.compile_cache import shared_compile_cache

    compiled = engine(tiny_digits_path, "int8-weight", "step", executor="mp", warmup=True,
                      compile={"mode": "regional", "cache_dir": str(shared_compile_cache())})
    try:
        (warmed,) = compiled.compile_warmup_stats
        got = digits(compiled)
        (after,) = compiled.collective_rpc("compile_stats")
    finally:
        compiled.close()
    plain = engine(tiny_digits_path, "int8-weight", "step")
    try:
        expected = digits(plain)
    finally:
        plain.close()
    assert warmed["mode_effective"] == "regional" and warmed["graphs"] >= 1, warmed
    assert (after["graphs"], after["recompiles"]) == (warmed["graphs"], 0), after
    for i in expected:
        assert np.abs(got[i].images.astype(int) - expected[i].images.astype(int)).max() <= 1, i


def test_a_lora_on_float8_storage_equals_diffusers_lora_on_the_same_storage(tiny_sd_path, tmp_path):
    """fp8-storage keeps each layer's weights in float8 and casts them to float32 as it runs: the LoRA factors compute
    in float32 (regression: they were cast to the stored float8). The adapted row is within 2 of diffusers' own LoRA
    on the stored weights (float8 values in float32 tensors: diffusers' PEFT layers cannot run over float8-stored
    convolutions on CPU)."""
    from lora_probes import write_adapter

    ink = write_adapter(tiny_sd_path, tmp_path / "ink", seed=3, text_encoder=False, gain=0.3)
    eng = engine(tiny_sd_path, "fp8-storage", "step", loras=[{"name": "ink", "path": ink}])
    try:
        with eng._lock:
            adapted = eng.add_request(SD.request("ink", "a cat 1", STEPS, SEED, guidance_scale=GUIDANCE,
                                                 loras=({"name": "ink", "scale": 1.0},)))
            plain = eng.add_request(SD.request("plain", "a cat 1", STEPS, SEED, guidance_scale=GUIDANCE))
        adapted, plain = adapted.result(timeout=120).images, plain.result(timeout=120).images
    finally:
        eng.close()
    assert np.abs(plain.astype(int) - bare_quantized(tiny_sd_path, "fp8-storage", "a cat 1", 1)).max() <= 2
    expected = run_bare(float8_rounded_with_lora(tiny_sd_path, ink), "a cat 1", 1)
    assert np.abs(adapted.astype(int) - expected.astype(int)).max() <= 2
    assert np.abs(adapted.astype(int) - plain.astype(int)).max() > 5, "the adapter changed nothing"
