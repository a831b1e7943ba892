"""Edits (img2img, inpaint) on the tiny SD: equal to the bare diffusers pipelines for the same seed, in
request mode (<= 1) and step mode (<= 2); same-shape same-strength edits fuse and each equals its solo run;
the step count is int(steps × strength); abort mid-edit releases everything."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, StableDiffusionImg2ImgPipeline, StableDiffusionInpaintPipeline
from engine_probes import assert_no_state, count_denoiser_calls, max_diff, runner_of, wait_until
from PIL import Image

from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.errors import InvalidRequestError, RequestAbortedError
from stage_runtime.request import DiffusionRequest, EditInput, SamplingParams

STEPS, SIZE = 10, 64


def picture(seed: int) -> np.ndarray:
    """A smooth, seeded test picture (uint8 RGB)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:SIZE, 0:SIZE] / SIZE
    base = np.stack([np.sin(6 * x + rng.uniform(0, 3)), np.cos(5 * y), x * y], -1)
    return ((base + 1) * 127).clip(0, 255).astype(np.uint8)


def square_mask() -> np.ndarray:
    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[16:48, 16:48] = 255
    return mask


def edit_request(rid: str, prompt: str, seed: int, image: np.ndarray, mask=None, strength=0.6, steps=STEPS, **kw):
    return DiffusionRequest(rid, prompt, SamplingParams(num_inference_steps=steps, seed=seed, **kw),
                            edit=EditInput(image, mask, strength))


def reference(path: str, prompt: str, seed: int, image: np.ndarray, mask=None, strength=0.6) -> np.ndarray:
    """The bare diffusers img2img / inpaint call built from the folder's components."""
    components = DiffusionPipeline.from_pretrained(path, local_files_only=True, low_cpu_mem_usage=False).components
    cls = StableDiffusionImg2ImgPipeline if mask is None else StableDiffusionInpaintPipeline
    pipe = cls(**components)
    pipe.set_progress_bar_config(disable=True)
    kwargs = {} if mask is None else {"mask_image": Image.fromarray(mask, "L"), "height": SIZE, "width": SIZE}
    out = pipe(prompt=prompt, image=Image.fromarray(image, "RGB"), strength=strength, num_inference_steps=STEPS,
               guidance_scale=7.5, generator=torch.Generator("cpu").manual_seed(seed), output_type="np", **kwargs)
    return (out.images * 255).round().clip(0, 255).astype(np.uint8)


@pytest.fixture(scope="module", params=["request", "step"])
def engine(request, tiny_sd_path):
    config = load_config({"model": {"path": tiny_sd_path}, "device": "cpu",
                          "scheduler": {"execution_mode": request.param, "max_num_seqs": 4,
                                        "request_batch_max_wait_ms": 300}})
    eng = DiffusionEngine.make_engine(config)
    yield eng
    eng.close()


def tolerance(engine) -> int:
    return 1 if engine.scheduler.mode == "request" else 2


@pytest.mark.parametrize("task", ["img2img", "inpaint"])
def test_edit_equals_the_diffusers_pipeline(engine, tiny_sd_path, task):
    mask = square_mask() if task == "inpaint" else None
    ref = reference(tiny_sd_path, "a red fox", 3, picture(0), mask)
    calls = count_denoiser_calls(engine)
    out = engine.add_request(edit_request(f"{task}-solo", "a red fox", 3, picture(0), mask)).result(timeout=60)
    assert out.images.shape == (1, SIZE, SIZE, 3)
    assert max_diff(out.images, ref) <= tolerance(engine)
    assert sum(calls) == int(STEPS * 0.6)                 # only the tail of the schedule runs
    if task == "inpaint":                                  # outside the mask the picture survives (roughly)
        assert not np.array_equal(out.images[0], reference(tiny_sd_path, "a red fox", 3, picture(0)))
    assert_no_state(engine)


def test_same_shape_same_strength_edits_fuse_and_each_equals_its_solo_run(engine, tiny_sd_path):
    refs = [reference(tiny_sd_path, p, s, picture(s)) for p, s in (("a cat", 1), ("a dog", 2))]
    calls = count_denoiser_calls(engine)
    streams = [engine.add_request(edit_request(f"pair-{s}", p, s, picture(s))) for p, s in (("a cat", 1), ("a dog", 2))]
    outs = [st.result(timeout=60) for st in streams]
    for out, ref in zip(outs, refs, strict=True):
        assert max_diff(out.images, ref) <= tolerance(engine)
    if engine.scheduler.mode == "request":
        assert sum(calls) == int(STEPS * 0.6)             # one fused call, not two
    else:
        assert sum(calls) < 2 * int(STEPS * 0.6)          # shared ticks
    assert_no_state(engine)


def test_different_strengths_do_not_fuse_in_request_mode(engine):
    a = edit_request("s-a", "a cat", 1, picture(1), strength=0.5)
    b = edit_request("s-b", "a cat", 1, picture(1), strength=0.7)
    assert a.batch_key != b.batch_key and a.batch_key.strength == 0.5
    assert a.step_key == b.step_key                        # step mode: each request has its own schedule
    calls = count_denoiser_calls(engine)
    for st in [engine.add_request(a), engine.add_request(b)]:
        st.result(timeout=60)
    if engine.scheduler.mode == "request":
        assert sum(calls) == 5 + 7                        # two calls
    else:
        assert sum(calls) < 5 + 7                         # shared ticks


def test_abort_mid_edit_releases_everything(engine):
    request = edit_request("abort-edit", "a cat", 4, picture(4), square_mask(), strength=1.0, steps=200, stream=True)
    stream = engine.add_request(request)
    wait_until(lambda: engine.requests_snapshot() and engine.requests_snapshot()[0]["step"] >= 1, timeout=60)
    engine.abort("abort-edit")
    with pytest.raises(RequestAbortedError):
        stream.result(timeout=60)
    wait_until(lambda: runner_of(engine).num_request_states() == 0, timeout=30)
    assert_no_state(engine)


def test_edit_validation_names_the_field(engine):
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(edit_request("bad-mask", "a cat", 1, picture(1), np.zeros((32, 32), np.uint8)))
    assert err.value.field == "mask"
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(edit_request("bad-strength", "a cat", 1, picture(1), strength=0.05))
    assert err.value.field == "strength"
