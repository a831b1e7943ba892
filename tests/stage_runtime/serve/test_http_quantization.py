"""A quantized stage over HTTP: the tiny SD with its UNet in int8 (``--quantization int8-weight``), step mode, two
LoRA adapters. Two requests with different adapters sharing denoising ticks are each within 2 (uint8) of the same
adapter on a stage serving the int8 weights dequantized back to float32 (the quantized base, exactly, without its
storage); ``/v1/stats.weights`` and ``diffstage_weight_bytes`` give the UNet's bytes before and after."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
import torch
from lora_probes import write_adapter
from serve_probes import decode_png, metric_samples
from stage_process import running_stage

from stage_runtime.quantization.methods import int8_weight

ADAPTERS = {"a": 1, "b": 2}


def dequantized_copy(sd_path: str, out) -> str:
    """The tiny SD with its UNet quantized as the stage quantizes it, then every quantized weight dequantized: the
    quantized base in plain float32 tensors."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(sd_path, local_files_only=True, low_cpu_mem_usage=False)
    layers = int8_weight(pipe.unet, (), torch.float32)
    assert layers, "nothing was quantized"
    for name in layers:
        module = pipe.unet.get_submodule(name)
        module.weight = torch.nn.Parameter(module.weight.dequantize(), requires_grad=False)
    pipe.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def stages(tiny_sd_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    adapters = [f"--lora={name}={write_adapter(tiny_sd_path, root / name, seed=seed, gain=0.3)}"
                for name, seed in ADAPTERS.items()]
    reference = dequantized_copy(tiny_sd_path, root / "dequantized")
    common = ["--device", "cpu", "--execution-mode", "step", "--max-num-seqs", "4", *adapters]
    with (running_stage(["--model", tiny_sd_path, "--quantization", "int8-weight", *common],
                        root / "int8.log") as int8,
          running_stage(["--model", reference, *common], root / "reference.log") as plain):
        yield int8, plain


async def two_adapters(url: str) -> dict[str, np.ndarray]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        async def one(name: str) -> np.ndarray:
            resp = await http.post("/v1/images/generations", json={
                "prompt": "a cat", "seed": 3, "size": "64x64", "num_inference_steps": 6,
                "loras": [{"name": name, "scale": 1.0}]})
            assert resp.status_code == 200, resp.text
            return decode_png(resp.json()["data"][0]["b64_json"])

        return dict(zip(ADAPTERS, await asyncio.gather(*(one(n) for n in ADAPTERS)), strict=True))


def batched_ticks(url: str) -> float:
    """Ticks that ran more than one request (the batch-size histogram's count above its first bucket)."""
    samples = metric_samples(httpx.get(f"{url}/metrics", timeout=30).text)
    return samples[("diffstage_batch_size_count", ())] - samples[("diffstage_batch_size_bucket", (("le", "1.0"),))]


def test_two_adapters_in_one_batch_on_an_int8_base_match_the_dequantized_base(stages):
    int8, plain = stages
    before = batched_ticks(int8.http_url)
    quantized, reference = asyncio.run(two_adapters(int8.http_url)), asyncio.run(two_adapters(plain.http_url))
    assert batched_ticks(int8.http_url) > before, "the two requests never shared a tick"
    for name in ADAPTERS:
        assert np.abs(quantized[name].astype(int) - reference[name].astype(int)).max() <= 2, name
    assert np.abs(quantized["a"].astype(int) - quantized["b"].astype(int)).max() >= 3, "the adapters changed nothing"


def test_the_unets_bytes_before_and_after(stages):
    int8, plain = stages
    unet = httpx.get(f"{int8.http_url}/v1/stats", timeout=30).json()["weights"]["components"]["unet"]
    assert unet["method"] == "int8-weight" and unet["layers_quantized"] > 0
    # int8 of float32 for its linear layers, and their scales; the UNet's convolutions stay float32 (int8-weight is
    # torchao's linear int8: fp8-storage stores convolutions too)
    assert unet["bytes"] < 0.75 * unet["bytes_as_loaded"], unet
    plain_unet = httpx.get(f"{plain.http_url}/v1/stats", timeout=30).json()["weights"]["components"]["unet"]
    assert plain_unet == {"bytes": unet["bytes_as_loaded"], "method": "none"}
    samples = metric_samples(httpx.get(f"{int8.http_url}/metrics", timeout=30).text)
    assert samples[("diffstage_weight_bytes", (("component", "unet"),))] == unet["bytes"]
    assert samples[("diffstage_weight_bytes_as_loaded", (("component", "unet"),))] == unet["bytes_as_loaded"]
