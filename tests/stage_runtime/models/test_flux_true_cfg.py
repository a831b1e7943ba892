"""FLUX.1 and Kontext true CFG (``negative_prompt`` with ``true_cfg_scale > 1``): each request equals diffusers'
own call with the same seed and the same two fields (request mode <= 1, step mode <= 2) — generations, FLUX
img2img, Kontext instruction edits — with ONE transformer forward per step in both modes (diffusers makes two):
a fused request-mode wave runs one forward per step for all its rows, and in step mode true-CFG requests share
ticks with plain ones of other step counts. Progress counts steps, the block cache keeps each request's two
halves apart, and abort mid-request releases everything."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_probes import assert_no_state, count_denoiser_calls, max_diff
from family_checks import (SIZE, bare_pipeline, check_abort_at_random_steps, check_progress_in_order, generators,
                           make_engine, req, to_uint8)
from PIL import Image

from stage_runtime.request import DiffusionRequest, EditInput, SamplingParams

torch.set_num_threads(1)
NEG, SCALE = "blurry, low quality", 4.0
TRUE_CFG = {"negative_prompt": NEG, "true_cfg_scale": SCALE}


def picture(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:SIZE, 0:SIZE] / SIZE
    base = np.stack([np.sin(6 * x + rng.uniform(0, 3)), np.cos(5 * y), x * y], -1)
    return ((base + 1) * 127).clip(0, 255).astype(np.uint8)


def bare(path: str, prompt: str, steps: int, seed: int, n: int = 1, pipeline_class: str | None = None,
         **kw) -> np.ndarray:
    """The bare diffusers call (true CFG by default: ``TRUE_CFG``), one generator per image, seed + i."""
    kw = {**TRUE_CFG, **kw}
    out = bare_pipeline(path, pipeline_class)(prompt=prompt, num_images_per_prompt=n, height=SIZE, width=SIZE,
                                              num_inference_steps=steps, guidance_scale=3.5,
                                              generator=generators(seed, n), output_type="np", **kw)
    return to_uint8(out.images)


def true_cfg_request(rid: str, prompt: str, steps: int, seed: int, **kw) -> DiffusionRequest:
    return req(rid, prompt, steps, seed, height=SIZE, width=SIZE, guidance_scale=3.5, **{**TRUE_CFG, **kw})


@pytest.fixture(scope="module")
def engines(tiny_flux_path, tiny_flux_kontext_path):
    """One engine per (family, mode), made when a test first asks for it and shared by the module."""
    made = {}
    paths = {"flux": tiny_flux_path, "kontext": tiny_flux_kontext_path}

    def get(family: str, mode: str):
        if (family, mode) not in made:
            made[family, mode] = make_engine(paths[family], mode, max_num_seqs=4, request_batch_max_wait_ms=300)
        return paths[family], made[family, mode]

    yield get
    for engine in made.values():
        engine.close()


def test_request_mode_fuses_a_true_cfg_wave_into_one_forward_per_step(engines):
    path, engine = engines("flux", "request")
    calls = count_denoiser_calls(engine)
    a = engine.add_request(true_cfg_request("a", "a photo of a cat", 4, 1))
    b = engine.add_request(true_cfg_request("b", "a red car", 4, 2, num_outputs=2))
    out_a, out_b = a.result(timeout=120).images, b.result(timeout=120).images
    assert calls[0] == 4, f"{calls[0]} transformer forwards for a fused 4-step wave (diffusers: 2 a step, a call)"
    assert max_diff(out_a, bare(path, "a photo of a cat", 4, 1)) <= 1
    assert max_diff(out_b, bare(path, "a red car", 4, 2, n=2)) <= 1
    plain = bare(path, "a photo of a cat", 4, 1, true_cfg_scale=1.0)          # diffusers: no negative pass
    assert max_diff(out_a, plain) > 10, "the negative pass changed nothing"
    assert_no_state(engine)


def test_step_mode_true_cfg_shares_ticks_with_plain_requests(engines):
    path, engine = engines("flux", "step")
    calls = count_denoiser_calls(engine)
    guided = engine.add_request(true_cfg_request("guided", "a photo of a cat", 6, 3))
    plain = engine.add_request(req("plain", "a red car", 3, 4, height=SIZE, width=SIZE, num_outputs=2))
    guided_out, plain_out = guided.result(timeout=120).images, plain.result(timeout=120).images
    assert calls[0] == 6, f"{calls[0]} forwards for 6 + 3 steps: the two did not share ticks"
    assert max_diff(guided_out, bare(path, "a photo of a cat", 6, 3)) <= 2
    assert max_diff(plain_out, bare(path, "a red car", 3, 4, n=2, negative_prompt=None, true_cfg_scale=1.0)) <= 2
    assert_no_state(engine)


@pytest.mark.parametrize("mode", ["request", "step"])
def test_an_empty_negative_prompt_is_one_as_in_diffusers(engines, mode):
    path, engine = engines("flux", mode)
    out = engine.add_request(true_cfg_request("empty", "a cat", 3, 5, negative_prompt="")).result(timeout=120)
    assert max_diff(out.images, bare(path, "a cat", 3, 5, negative_prompt="")) <= (1 if mode == "request" else 2)
    assert max_diff(out.images, bare(path, "a cat", 3, 5, true_cfg_scale=1.0)) > 10
    assert_no_state(engine)


@pytest.mark.parametrize("mode", ["request", "step"])
def test_flux_img2img_with_true_cfg_equals_the_bare_img2img_call(engines, mode):
    path, engine = engines("flux", mode)
    request = DiffusionRequest("i2i", "a red fox", SamplingParams(num_inference_steps=10, seed=3, guidance_scale=3.5,
                                                                  **TRUE_CFG), edit=EditInput(picture(0), None, 0.55))
    calls = count_denoiser_calls(engine)
    out = engine.add_request(request).result(timeout=120)
    ref = bare(path, "a red fox", 10, 3, pipeline_class="FluxImg2ImgPipeline", image=Image.fromarray(picture(0)),
               strength=0.55)
    assert max_diff(out.images, ref) <= (1 if mode == "request" else 2)
    assert sum(calls) == 6                               # the strength's tail of the schedule, one forward a step
    assert_no_state(engine)


@pytest.mark.parametrize("mode", ["request", "step"])
def test_kontext_generations_and_instruction_edits_with_true_cfg(engines, mode):
    path, engine = engines("kontext", mode)
    tolerance = 1 if mode == "request" else 2
    gen = engine.add_request(true_cfg_request("k-gen", "a cat", 4, 7)).result(timeout=120)
    assert max_diff(gen.images, bare(path, "a cat", 4, 7, max_area=SIZE * SIZE)) <= tolerance
    edit = DiffusionRequest("k-edit", "make it blue", SamplingParams(num_inference_steps=4, seed=8, guidance_scale=3.5,
                                                                     **TRUE_CFG), edit=EditInput(picture(1)))
    calls = count_denoiser_calls(engine)
    out = engine.add_request(edit).result(timeout=120)
    ref = bare(path, "make it blue", 4, 8, image=Image.fromarray(picture(1)), max_area=SIZE * SIZE,
               _auto_resize=False)
    assert max_diff(out.images, ref) <= tolerance and sum(calls) == 4
    assert_no_state(engine)


def test_request_mode_progress_counts_steps_and_abort_releases_everything(engines):
    _, engine = engines("flux", "request")
    check_progress_in_order(engine, "a cat", height=SIZE, width=SIZE, **TRUE_CFG)
    check_abort_at_random_steps(engine, "a cat", rounds=2, height=SIZE, width=SIZE, **TRUE_CFG)


def test_step_mode_abort_at_random_steps_releases_everything(engines):
    _, engine = engines("flux", "step")
    check_abort_at_random_steps(engine, "a cat", rounds=2, height=SIZE, width=SIZE, **TRUE_CFG)


@pytest.mark.parametrize("mode", ["request", "step"])
def test_the_block_cache_runs_on_both_halves_of_a_true_cfg_request(engines, mode):
    path, engine = engines("flux", mode)
    request = true_cfg_request("cached", "a cat", 8, 9, cache={"threshold": 0.3})
    out = engine.add_request(request).result(timeout=120)
    assert out.metrics["steps_skipped"] > 0 and out.metrics["steps_computed"] + out.metrics["steps_skipped"] == 8
    assert max_diff(out.images, bare(path, "a cat", 8, 9)) <= 8
    assert_no_state(engine)
