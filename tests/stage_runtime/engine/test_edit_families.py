"""Edits beyond Stable Diffusion: FLUX.1 and SDXL img2img, FLUX.1 Kontext instruction edits. Each equals the bare
diffusers edit pipeline for the same seed (request mode <= 1, step mode <= 2); same-shape edits fuse and each
equals its solo run; step mode runs (and reports) the family's step count for the strength; abort mid-edit
releases everything; a task the family cannot do is refused naming the field. (SDXL and FLUX.1 inpainting:
test_inpaint_families.py.)"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from diffusers import FluxImg2ImgPipeline, FluxKontextPipeline, StableDiffusionXLImg2ImgPipeline
from engine_probes import (assert_no_state, count_denoiser_calls, max_diff, phased, progress_of, runner_of,
                           wait_until)
from PIL import Image

from stage_runtime.config import ParallelConfig, load_config
from stage_runtime.distributed.apply import apply_parallelism
from stage_runtime.engine import DiffusionEngine
from stage_runtime.errors import ConfigError, InvalidRequestError, RequestAbortedError
from stage_runtime.request import DiffusionRequest, EditInput, SamplingParams

STEPS, SIZE = 10, 64
# family → (tiny folder fixture, bare diffusers edit pipeline, strength, denoising steps diffusers runs for it).
# 10 × 0.55 = 5.5: SDXL's int(steps × strength) runs 5, FLUX's steps − int(steps − steps × strength) runs 6.
FAMILIES = {
    "flux": ("tiny_flux_path", FluxImg2ImgPipeline, 0.55, 6),
    "sdxl": ("tiny_sdxl_path", StableDiffusionXLImg2ImgPipeline, 0.55, 5),
    "kontext": ("tiny_flux_kontext_path", FluxKontextPipeline, None, STEPS),
}
GUIDANCE = {"flux": 3.5, "sdxl": 5.0, "kontext": 3.5}


def picture(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:SIZE, 0:SIZE] / SIZE
    base = np.stack([np.sin(6 * x + rng.uniform(0, 3)), np.cos(5 * y), x * y], -1)
    return ((base + 1) * 127).clip(0, 255).astype(np.uint8)


@functools.lru_cache(maxsize=None)
def bare(cls, path: str):
    extra = {"add_watermarker": False} if cls is StableDiffusionXLImg2ImgPipeline else {}
    pipe = cls.from_pretrained(path, local_files_only=True, low_cpu_mem_usage=False, **extra)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference(family: str, path: str, prompt: str, seed: int, image: np.ndarray, n: int = 1) -> np.ndarray:
    """The bare diffusers edit call (Kontext: conditioned at the request's size, see models/families/flux_kontext.py);
    ``n`` images from generators seed, seed+1… (the engine's per-image generators)."""
    _, cls, strength, _ = FAMILIES[family]
    kwargs = ({"max_area": SIZE * SIZE, "_auto_resize": False} if family == "kontext" else {"strength": strength})
    if family != "sdxl":
        kwargs.update(height=SIZE, width=SIZE)
    out = bare(cls, path)(prompt=prompt, image=Image.fromarray(image, "RGB"), num_inference_steps=STEPS,
                          guidance_scale=GUIDANCE[family], num_images_per_prompt=n, output_type="np",
                          generator=[torch.Generator("cpu").manual_seed(seed + i) for i in range(n)], **kwargs)
    return (out.images * 255).round().clip(0, 255).astype(np.uint8)


def edit_request(family: str, rid: str, prompt: str, seed: int, image: np.ndarray, mask=None, steps=STEPS, **kw):
    return DiffusionRequest(rid, prompt, SamplingParams(num_inference_steps=steps, seed=seed, **kw),
                            edit=EditInput(image, mask, FAMILIES[family][2]))


ALL = [(f, m) for f in FAMILIES for m in ("request", "step")]
STEP = [(f, "step") for f in FAMILIES]
TRANSFORMERS = [(f, m) for f, m in ALL if f != "sdxl"]          # the block cache is a transformer-stack feature


def cases(which: list[tuple[str, str]]):
    return pytest.mark.parametrize("family, mode", which, ids=[f"{f}-{m}" for f, m in which])


@pytest.fixture(scope="module")
def engines():
    """One engine per (family, mode), made when a test first asks for it and shared by the module."""
    made: dict[tuple[str, str], tuple[str, DiffusionEngine]] = {}

    def get(family: str, mode: str, path: str) -> tuple[str, DiffusionEngine]:
        if (family, mode) not in made:
            config = load_config({"model": {"path": path}, "device": "cpu", "scheduler": {
                "execution_mode": mode, "max_num_seqs": 4, "request_batch_max_wait_ms": 300}})
            made[family, mode] = path, DiffusionEngine.make_engine(config)
        return made[family, mode]

    yield get
    for _, engine in made.values():
        engine.close()


@pytest.fixture
def case(request, engines, family, mode):
    return (family, *engines(family, mode, request.getfixturevalue(FAMILIES[family][0])))


def tolerance(engine) -> int:
    return 1 if engine.scheduler.mode == "request" else 2


@cases(ALL)
def test_edit_equals_the_diffusers_pipeline(case):
    family, path, engine = case
    ref = reference(family, path, "a red fox", 3, picture(0))
    calls = count_denoiser_calls(engine)
    out = engine.add_request(edit_request(family, f"{family}-solo", "a red fox", 3, picture(0))).result(timeout=120)
    assert out.images.shape == (1, SIZE, SIZE, 3)
    assert max_diff(out.images, ref) <= tolerance(engine)
    assert sum(calls) == FAMILIES[family][3]            # only the strength's tail of the schedule runs
    assert_no_state(engine)


@cases(ALL)
def test_same_shape_edits_fuse_and_each_equals_its_solo_run(case):
    family, path, engine = case
    pairs = (("a cat", 1, 1), ("a dog", 2, 2))             # (prompt, seed, images)
    refs = [reference(family, path, p, s, picture(s), n) for p, s, n in pairs]
    calls = count_denoiser_calls(engine)
    streams = [engine.add_request(edit_request(family, f"pair-{s}", p, s, picture(s), num_outputs=n))
               for p, s, n in pairs]
    for stream, ref in zip(streams, refs, strict=True):
        assert max_diff(stream.result(timeout=120).images, ref) <= tolerance(engine)
    steps = FAMILIES[family][3]
    if engine.scheduler.mode == "request":
        assert sum(calls) == steps                       # one fused call, not two
    else:
        assert sum(calls) < 2 * steps                    # shared ticks
    assert_no_state(engine)


@cases(STEP)
def test_step_mode_reports_the_edit_step_count(case):
    family, _, engine = case
    stream = engine.add_request(edit_request(family, "progress", "a cat", 5, picture(5), stream=True))
    items = list(stream)
    steps = FAMILIES[family][3]
    assert progress_of(items) == phased(steps) and {o.num_steps for o in items} == {steps}
    assert items[-1].finished and items[-1].images.shape == (1, SIZE, SIZE, 3)
    assert_no_state(engine)


@cases(ALL)
def test_abort_mid_edit_releases_everything(case):
    family, _, engine = case
    stream = engine.add_request(edit_request(family, "abort-edit", "a cat", 4, picture(4), steps=200, stream=True))
    wait_until(lambda: engine.requests_snapshot() and engine.requests_snapshot()[0]["step"] >= 1, timeout=60)
    engine.abort("abort-edit")
    with pytest.raises(RequestAbortedError):
        stream.result(timeout=60)
    wait_until(lambda: runner_of(engine).num_request_states() == 0, timeout=30)
    assert_no_state(engine)


@cases(ALL)
def test_a_task_the_family_cannot_do_is_refused_naming_the_field(case):
    family, _, engine = case
    info = engine.model_info
    assert info.edit_tasks == (("instruct",) if family == "kontext" else ("img2img", "inpaint"))
    if family != "kontext":
        return
    mask = np.full((SIZE, SIZE), 255, np.uint8)
    with pytest.raises(InvalidRequestError, match="inpaint") as err:
        engine.add_request(edit_request(family, "no-inpaint", "a cat", 1, picture(1), mask))
    assert err.value.field == "mask"
    # instruction edits have no strength
    request = DiffusionRequest("strength", "a cat", SamplingParams(seed=1), edit=EditInput(picture(1), None, 0.5))
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(request)
    assert err.value.field == "strength"
    assert_no_state(engine)


@cases([("kontext", "request"), ("kontext", "step")])
def test_kontext_serves_generations_which_never_share_a_forward_with_edits(case):
    family, path, engine = case
    gen = DiffusionRequest("kontext-gen", "a cat", SamplingParams(num_inference_steps=STEPS, seed=7))
    edit = edit_request(family, "kontext-edit", "a cat", 7, picture(7))
    info = engine.model_info
    assert gen.resolve(info).step_key != edit.resolve(info).step_key
    assert gen.resolve(info).batch_key != edit.resolve(info).batch_key
    out = bare(FluxKontextPipeline, path)(prompt="a cat", height=SIZE, width=SIZE, max_area=SIZE * SIZE,
                                          num_inference_steps=STEPS, guidance_scale=3.5, output_type="np",
                                          generator=torch.Generator("cpu").manual_seed(7))
    ref = (out.images * 255).round().clip(0, 255).astype(np.uint8)
    assert max_diff(engine.add_request(gen).result(timeout=120).images, ref) <= tolerance(engine)
    assert_no_state(engine)


@cases([("kontext", "request")])
def test_kontext_refuses_in_model_parallelism_with_the_reason(case):
    _, _, engine = case
    with pytest.raises(ConfigError, match=r"ulysses_degree=2 is not supported by FluxKontextPipeline.*conditioning"):
        apply_parallelism(runner_of(engine).adapter, None, ParallelConfig(ulysses_degree=2))


def test_sdxl_step_edit_encodes_with_the_vae_upcast_and_puts_it_back(tiny_sdxl_path):
    """force_upcast (SDXL's VAE overflows in float16): the image is encoded in float32, the VAE returns to the
    serving dtype, and the edit's latents are in the serving dtype (here bfloat16)."""
    from stage_runtime.config import ModelConfig
    from stage_runtime.models.registry import resolve_adapter_class

    adapter = resolve_adapter_class(ModelConfig(path=tiny_sdxl_path)).load(tiny_sdxl_path, torch.device("cpu"),
                                                                             "bfloat16")
    assert adapter.pipe.vae.config.force_upcast
    encoded = []
    adapter.pipe.vae.encoder.register_forward_pre_hook(
        lambda module, args: encoded.append((args[0].dtype, next(module.parameters()).dtype)))
    request = edit_request("sdxl", "bf16", "a cat", 1, picture(1)).resolve(adapter.info())
    state = adapter.prepare_encode(request)
    assert encoded == [(torch.float32, torch.float32)]
    assert adapter.pipe.vae.dtype == torch.bfloat16 and state.latents.dtype == torch.bfloat16
    assert torch.isfinite(state.latents.float()).all() and state.t_start == STEPS - FAMILIES["sdxl"][3]


@cases(TRANSFORMERS)
def test_transformer_edits_run_under_the_block_cache(case):
    """FLUX img2img and Kontext edits take a request's ``cache`` (models.block_cache): blocks are skipped,
    and the image stays near the uncached one (the tiny model's residuals barely move)."""
    family, path, engine = case
    request = edit_request(family, "cached", "a red fox", 3, picture(0), cache={"threshold": 0.3})
    out = engine.add_request(request).result(timeout=120)
    assert out.metrics["steps_skipped"] > 0
    assert out.metrics["steps_computed"] + out.metrics["steps_skipped"] == FAMILIES[family][3]
    assert max_diff(out.images, reference(family, path, "a red fox", 3, picture(0))) <= 8
    assert_no_state(engine)
