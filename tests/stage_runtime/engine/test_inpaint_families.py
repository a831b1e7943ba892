"""Inpainting on Stable Diffusion (``StableDiffusionInpaintPipeline``), SDXL (``StableDiffusionXLInpaintPipeline``, a 4-channel UNet) and FLUX.1 (``FluxInpaintPipeline``),
served from their generation folders: the edit pipelines are built over the SAME modules (no weight copied).
Each inpaint equals the bare diffusers inpaint pipeline for the same seed (request mode <= 1, step mode <= 2),
n images as its ``num_images_per_prompt``; same-shape inpaints fuse into one call (request mode) or share ticks
with img2img edits and generations (step mode), each equal to its solo run; strength 1 (SDXL starts from pure
noise there); FLUX.1 inpainting with true CFG; progress reports the strength's step count; abort mid-inpaint
releases everything."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from diffusers import FluxImg2ImgPipeline, FluxInpaintPipeline, StableDiffusionImg2ImgPipeline
from diffusers import StableDiffusionInpaintPipeline, StableDiffusionXLImg2ImgPipeline, StableDiffusionXLInpaintPipeline
from engine_probes import (assert_no_state, count_denoiser_calls, max_diff, phased, progress_of, runner_of,
                           wait_until)
from PIL import Image

from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.errors import RequestAbortedError
from stage_runtime.request import DiffusionRequest, EditInput, SamplingParams

STEPS, SIZE, STRENGTH = 10, 64, 0.55
# family → (tiny folder fixture, bare inpaint and img2img pipelines, guidance, steps diffusers runs at STRENGTH):
# 10 × 0.55 = 5.5: SDXL's int(steps × strength) runs 5, FLUX's steps − int(steps − steps × strength) runs 6.
FAMILIES = {
    "sd": ("tiny_sd_path", StableDiffusionInpaintPipeline, StableDiffusionImg2ImgPipeline, 7.5, 5),
    "sdxl": ("tiny_sdxl_path", StableDiffusionXLInpaintPipeline, StableDiffusionXLImg2ImgPipeline, 5.0, 5),
    "flux": ("tiny_flux_path", FluxInpaintPipeline, FluxImg2ImgPipeline, 3.5, 6),
}
ALL = [(f, m) for f in FAMILIES for m in ("request", "step")]


def cases(which):
    return pytest.mark.parametrize("family, mode", which, ids=[f"{f}-{m}" for f, m in which])


def picture(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:SIZE, 0:SIZE] / SIZE
    base = np.stack([np.sin(6 * x + rng.uniform(0, 3)), np.cos(5 * y), x * y], -1)
    return ((base + 1) * 127).clip(0, 255).astype(np.uint8)


def square_mask(seed: int = 0) -> np.ndarray:
    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[8 + seed:40 + seed, 16:48] = 255
    return mask


@functools.lru_cache(maxsize=None)
def bare(cls, path: str):
    extra = {"add_watermarker": False} if "StableDiffusionXL" in cls.__name__ else {}
    pipe = cls.from_pretrained(path, local_files_only=True, low_cpu_mem_usage=False, **extra)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference(family: str, path: str, prompt: str, seed: int, n: int = 1, mask: bool = True,
              strength: float = STRENGTH, **kw) -> np.ndarray:
    """The bare diffusers inpaint (or, ``mask=False``, img2img) call; ``n`` images from generators seed, seed+1…"""
    _, inpaint, img2img, guidance, _ = FAMILIES[family]
    if mask:
        kw["mask_image"] = Image.fromarray(square_mask(seed), "L")
    out = bare(inpaint if mask else img2img, path)(
        prompt=prompt, image=Image.fromarray(picture(seed), "RGB"), strength=strength, height=SIZE, width=SIZE,
        num_inference_steps=STEPS, guidance_scale=guidance, num_images_per_prompt=n, output_type="np",
        generator=[torch.Generator("cpu").manual_seed(seed + i) for i in range(n)], **kw)
    return (out.images * 255).round().clip(0, 255).astype(np.uint8)


def inpaint_request(family: str, rid: str, prompt: str, seed: int, mask: bool = True, strength: float = STRENGTH,
                    steps: int = STEPS, **kw) -> DiffusionRequest:
    sampling = SamplingParams(num_inference_steps=steps, seed=seed, guidance_scale=FAMILIES[family][3], **kw)
    return DiffusionRequest(rid, prompt, sampling,
                            edit=EditInput(picture(seed), square_mask(seed) if mask else None, strength))


@pytest.fixture(scope="module")
def engines():
    made: dict[tuple[str, str], DiffusionEngine] = {}

    def get(family: str, mode: str, path: str) -> DiffusionEngine:
        if (family, mode) not in made:
            config = load_config({"model": {"path": path}, "device": "cpu", "scheduler": {
                "execution_mode": mode, "max_num_seqs": 4, "request_batch_max_wait_ms": 300}})
            made[family, mode] = DiffusionEngine.make_engine(config)
        return made[family, mode]

    yield get
    for engine in made.values():
        engine.close()


@pytest.fixture
def case(request, engines, family, mode):
    path = request.getfixturevalue(FAMILIES[family][0])
    return family, path, engines(family, mode, path)


def tolerance(engine) -> int:
    return 1 if engine.scheduler.mode == "request" else 2


@cases(ALL)
def test_inpaint_equals_the_diffusers_inpaint_pipeline(case):
    family, path, engine = case
    assert engine.model_info.edit_tasks == ("img2img", "inpaint")
    calls = count_denoiser_calls(engine)
    out = engine.add_request(inpaint_request(family, "solo", "a red fox", 3)).result(timeout=120)
    assert out.images.shape == (1, SIZE, SIZE, 3)
    assert max_diff(out.images, reference(family, path, "a red fox", 3)) <= tolerance(engine)
    assert sum(calls) == FAMILIES[family][4]                 # only the strength's tail of the schedule runs
    assert max_diff(out.images, reference(family, path, "a red fox", 3, mask=False)) > 10   # the mask counts
    assert_no_state(engine)


@cases(ALL)
def test_same_shape_inpaints_fuse_and_each_equals_its_solo_run(case):
    family, path, engine = case
    pairs = (("a cat", 1, 1), ("a dog", 2, 2))               # (prompt, seed, images)
    refs = [reference(family, path, p, s, n) for p, s, n in pairs]
    calls = count_denoiser_calls(engine)
    streams = [engine.add_request(inpaint_request(family, f"pair-{s}", p, s, num_outputs=n)) for p, s, n in pairs]
    for stream, ref in zip(streams, refs, strict=True):
        assert max_diff(stream.result(timeout=120).images, ref) <= tolerance(engine)
    steps = FAMILIES[family][4]
    assert sum(calls) == steps if engine.scheduler.mode == "request" else sum(calls) < 2 * steps
    assert_no_state(engine)


@cases([(f, "step") for f in FAMILIES])
def test_step_mode_inpaints_share_ticks_with_img2img_and_generations(case):
    family, path, engine = case
    calls = count_denoiser_calls(engine)
    inpaint = engine.add_request(inpaint_request(family, "tick-inpaint", "a cat", 4))
    img2img = engine.add_request(inpaint_request(family, "tick-img2img", "a dog", 5, mask=False))
    gen = engine.add_request(DiffusionRequest("tick-gen", "a tree", SamplingParams(
        num_inference_steps=3, seed=6, height=SIZE, width=SIZE, guidance_scale=FAMILIES[family][3])))
    assert max_diff(inpaint.result(timeout=120).images, reference(family, path, "a cat", 4)) <= 2
    assert max_diff(img2img.result(timeout=120).images, reference(family, path, "a dog", 5, mask=False)) <= 2
    assert gen.result(timeout=120).images.shape == (1, SIZE, SIZE, 3)
    assert sum(calls) < 2 * FAMILIES[family][4] + 3          # shared ticks
    assert_no_state(engine)


@cases(ALL)
def test_strength_one_inpaint_equals_the_diffusers_call(case):
    family, path, engine = case
    request = inpaint_request(family, "full", "a blue bird", 7, strength=1.0, negative_prompt="blurry",
                              **({"true_cfg_scale": 3.0} if family == "flux" else {}))
    out = engine.add_request(request).result(timeout=120)
    extra = {"negative_prompt": "blurry", **({"true_cfg_scale": 3.0} if family == "flux" else {})}
    assert max_diff(out.images, reference(family, path, "a blue bird", 7, strength=1.0, **extra)) <= tolerance(engine)
    assert_no_state(engine)


@cases([("flux", "request"), ("flux", "step")])
def test_flux_inpaint_with_true_cfg_makes_one_forward_per_step(case):
    family, path, engine = case
    calls = count_denoiser_calls(engine)
    out = engine.add_request(inpaint_request(family, "cfg", "a cat", 8, negative_prompt="ugly",
                                             true_cfg_scale=4.0)).result(timeout=120)
    ref = reference(family, path, "a cat", 8, negative_prompt="ugly", true_cfg_scale=4.0)
    assert max_diff(out.images, ref) <= tolerance(engine) and sum(calls) == FAMILIES[family][4]
    assert max_diff(out.images, reference(family, path, "a cat", 8)) > 10
    assert_no_state(engine)


@cases([(f, "step") for f in FAMILIES])
def test_step_mode_reports_the_inpaint_step_count(case):
    family, _, engine = case
    items = list(engine.add_request(inpaint_request(family, "progress", "a cat", 5, stream=True)))
    steps = FAMILIES[family][4]
    assert progress_of(items) == phased(steps) and {o.num_steps for o in items} == {steps}
    assert items[-1].finished and items[-1].images.shape == (1, SIZE, SIZE, 3)
    assert_no_state(engine)


@cases(ALL)
def test_abort_mid_inpaint_releases_everything(case):
    family, _, engine = case
    stream = engine.add_request(inpaint_request(family, "abort", "a cat", 4, strength=1.0, steps=200, stream=True))
    wait_until(lambda: engine.requests_snapshot() and engine.requests_snapshot()[0]["step"] >= 1, timeout=60)
    engine.abort("abort")
    with pytest.raises(RequestAbortedError):
        stream.result(timeout=60)
    wait_until(lambda: runner_of(engine).num_request_states() == 0, timeout=30)
    assert_no_state(engine)


@cases([("sdxl", "request"), ("flux", "request")])
def test_the_inpaint_pipeline_shares_every_module_of_the_generation_pipeline(case):
    family, _, engine = case
    adapter = runner_of(engine).adapter
    engine.add_request(inpaint_request(family, "built", "a cat", 1, steps=2)).result(timeout=120)
    pipes = adapter._edit_pipelines() if family == "sdxl" else adapter._flux_edit_pipelines()
    for name, module in adapter.pipe.components.items():
        if isinstance(module, torch.nn.Module):
            assert pipes["inpaint"].components[name] is module, name       # the same object: no weight copied
