"""LoRA rows under FLUX.1's true CFG: a request's adapters apply to both of its halves (the prompt's and the negative
prompt's rows, and the CLIP encode of each), next to a request with other adapters and no true CFG in the same
forward; and on a FLUX.1 inpaint. Each equals diffusers' ``load_lora_weights`` + ``set_adapters`` with the
same true CFG call (request mode <= 1, step mode <= 2)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FluxInpaintPipeline
from engine_probes import assert_no_state, count_denoiser_calls, max_diff
from lora_probes import bare_with_loras, load_pipe, write_adapter
from PIL import Image

from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.request import DiffusionRequest, EditInput, SamplingParams

PROMPT, STEPS, SIZE = "a photo of a cat", 4, 64
TRUE_CFG = {"negative_prompt": "blurry", "true_cfg_scale": 4.0}


@pytest.fixture(scope="module")
def adapters(tiny_flux_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora-true-cfg")
    return {name: write_adapter(tiny_flux_path, out / name, seed=seed, gain=1.0) for name, seed in (("a", 1), ("b", 2))}


@pytest.fixture(scope="module", params=["request", "step"])
def engine(request, tiny_flux_path, adapters):
    config = load_config({"model": {"path": tiny_flux_path}, "device": "cpu", "warmup": False,
                          "loras": [{"name": n, "path": p} for n, p in adapters.items()],
                          "scheduler": {"execution_mode": request.param, "max_num_seqs": 4,
                                        "request_batch_max_wait_ms": 300}})
    eng = DiffusionEngine.make_engine(config)
    yield eng
    eng.close()


def tolerance(engine) -> int:
    return 1 if engine.scheduler.mode == "request" else 2


def test_a_true_cfg_request_with_an_adapter_equals_diffusers_with_it(engine, tiny_flux_path, adapters):
    guided = DiffusionRequest("guided", PROMPT, SamplingParams(num_inference_steps=STEPS, seed=3, height=SIZE,
                                                               width=SIZE, loras=[{"name": "a", "scale": 0.9}],
                                                               **TRUE_CFG))
    plain = DiffusionRequest("plain", PROMPT, SamplingParams(num_inference_steps=STEPS, seed=4, height=SIZE,
                                                             width=SIZE, loras=[{"name": "b", "scale": 1.0}]))
    calls = count_denoiser_calls(engine)
    streams = [engine.add_request(r) for r in (guided, plain)]
    guided_out, plain_out = (s.result(timeout=120).images for s in streams)
    ref = bare_with_loras(tiny_flux_path, {"a": adapters["a"]}, [0.9], PROMPT, STEPS, 3, guidance_scale=3.5,
                          negative_prompt=["blurry"], true_cfg_scale=4.0)
    assert max_diff(guided_out, ref) <= tolerance(engine)
    assert max_diff(guided_out, bare_with_loras(tiny_flux_path, {}, None, PROMPT, STEPS, 3, guidance_scale=3.5,
                                                negative_prompt=["blurry"], true_cfg_scale=4.0)) > 5   # a counts
    ref = bare_with_loras(tiny_flux_path, {"b": adapters["b"]}, [1.0], PROMPT, STEPS, 4, guidance_scale=3.5)
    assert max_diff(plain_out, ref) <= tolerance(engine)
    if engine.scheduler.mode == "step":
        assert calls[0] == STEPS                      # one forward a step for both: their rows side by side
    assert_no_state(engine)


def test_a_true_cfg_inpaint_with_an_adapter_equals_diffusers_with_it(engine, tiny_flux_path, adapters):
    y, x = np.mgrid[0:SIZE, 0:SIZE] / SIZE
    image = ((np.stack([np.sin(6 * x), np.cos(5 * y), x * y], -1) + 1) * 127).astype(np.uint8)
    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[16:48, 8:40] = 255
    out = engine.add_request(DiffusionRequest("inpaint", PROMPT, SamplingParams(
        num_inference_steps=6, seed=5, guidance_scale=3.5, loras=[{"name": "a", "scale": 0.9}], **TRUE_CFG),
        edit=EditInput(image, mask, 0.7))).result(timeout=120).images
    pipe = load_pipe(tiny_flux_path)
    pipe.load_lora_weights(adapters["a"], adapter_name="a")
    pipe.set_adapters(["a"], [0.9])
    ref = FluxInpaintPipeline.from_pipe(pipe)(
        prompt=PROMPT, image=Image.fromarray(image, "RGB"), mask_image=Image.fromarray(mask, "L"), strength=0.7,
        height=SIZE, width=SIZE, num_inference_steps=6, guidance_scale=3.5, output_type="np",
        generator=torch.Generator("cpu").manual_seed(5), **TRUE_CFG).images
    assert max_diff(out, (ref * 255).round().clip(0, 255).astype(np.uint8)) <= tolerance(engine)
    assert_no_state(engine)
