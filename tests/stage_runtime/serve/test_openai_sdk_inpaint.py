"""The official ``openai`` SDK against an SDXL stage (step mode) and a FLUX.1 stage (request mode), each a real stage
process: ``client.images.edit(image=..., mask=..., prompt=...)`` inpaints (OpenAI's mask: the transparent pixels
are repainted) equal to the bare diffusers inpaint pipeline; FLUX.1 true CFG through ``extra_body``
(``negative_prompt``, ``true_cfg_scale``) equals ``FluxPipeline``; the edge and admission answer 400 naming the
field, with what to send instead, for what a family cannot take."""

from __future__ import annotations

import base64
import contextlib
import io

import numpy as np
import openai
import pytest
import torch
from diffusers import FluxInpaintPipeline, FluxPipeline, StableDiffusionXLInpaintPipeline
from PIL import Image
from stage_process import running_stage

STEPS, SIZE = 6, 64
STAGES = {"sdxl": ("tiny_sdxl_path", "step", StableDiffusionXLInpaintPipeline, 5.0),
          "flux": ("tiny_flux_path", "request", FluxInpaintPipeline, 3.5)}


@pytest.fixture(scope="module")
def stages(request, tmp_path_factory):
    """One stage process per family, started when a test first asks for it and shared by the module."""
    with contextlib.ExitStack() as stack:
        started = {}

        def get(family: str):
            if family not in started:
                fixture, mode, _, _ = STAGES[family]
                log = tmp_path_factory.mktemp(f"{family}-stage") / "stage.log"
                started[family] = stack.enter_context(running_stage(
                    ["--model", request.getfixturevalue(fixture), "--served-name", f"tiny-{family}", "--device",
                     "cpu", "--executor", "uni", "--execution-mode", mode, "--max-num-seqs", "2"], log))
            return started[family]

        yield get


@pytest.fixture(params=list(STAGES))
def family(request):
    return request.param


@pytest.fixture
def client(stages, family):
    with openai.OpenAI(base_url=f"{stages(family).http_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def png(array: np.ndarray, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array, mode).save(buf, format="PNG")
    return buf.getvalue()


def picture() -> np.ndarray:
    y, x = np.mgrid[0:SIZE, 0:SIZE] / SIZE
    return ((np.stack([np.sin(6 * x), np.cos(5 * y), x * y], -1) + 1) * 127).astype(np.uint8)


def repaint() -> np.ndarray:
    """255 where the picture is repainted (diffusers' mask)."""
    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[16:48, 8:40] = 255
    return mask


def decoded(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def uint8(images) -> np.ndarray:
    return (np.asarray(images) * 255).round().clip(0, 255).astype(np.uint8)


def bare(cls, path: str, **kw) -> np.ndarray:
    extra = {"add_watermarker": False} if cls is StableDiffusionXLInpaintPipeline else {}
    pipe = cls.from_pretrained(path, local_files_only=True, low_cpu_mem_usage=False, **extra)
    pipe.set_progress_bar_config(disable=True)
    return uint8(pipe(height=SIZE, width=SIZE, num_inference_steps=STEPS, output_type="np", **kw).images)[0]


def test_models_list_says_the_family_inpaints(client, family):
    facts = client.models.list().data[0].diffstage
    assert facts["edit_tasks"] == ["img2img", "inpaint"] and facts["true_cfg"] is (family == "flux")


def test_edit_with_an_openai_mask_is_the_bare_inpaint(client, family, request):
    fixture, mode, cls, guidance = STAGES[family]
    alpha = np.where(repaint() == 255, 0, 255).astype(np.uint8)            # OpenAI: transparent = repaint
    # a negative prompt: SDXL's CFG rows; FLUX.1's true CFG (form fields, as the SDK sends extra_body on an edit)
    negative = {"negative_prompt": "blurry", **({"true_cfg_scale": 3.0} if family == "flux" else {})}
    result = client.images.edit(
        image=("in.png", png(picture()), "image/png"), prompt="a red fox", size="auto",
        mask=("mask.png", png(np.dstack([picture(), alpha]), "RGBA"), "image/png"),
        extra_body={"num_inference_steps": STEPS, "seed": 5, "guidance_scale": guidance, "strength": 0.7, **negative})
    ref = bare(cls, request.getfixturevalue(fixture), prompt="a red fox", image=Image.fromarray(picture()),
               mask_image=Image.fromarray(repaint(), "L"), strength=0.7, guidance_scale=guidance,
               generator=torch.Generator("cpu").manual_seed(5), **negative)
    image = decoded(result.data[0].b64_json)
    assert image.shape == (SIZE, SIZE, 3)
    assert int(np.abs(image.astype(int) - ref.astype(int)).max()) <= (2 if mode == "step" else 1)


def test_flux_true_cfg_through_extra_body_is_the_bare_call(stages, tiny_flux_path):
    with openai.OpenAI(base_url=f"{stages('flux').http_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        result = c.images.generate(prompt="a red fox", size="64x64", extra_body={
            "num_inference_steps": STEPS, "seed": 3, "negative_prompt": "blurry", "true_cfg_scale": 4.0})
    ref = bare(FluxPipeline, tiny_flux_path, prompt="a red fox", negative_prompt="blurry", true_cfg_scale=4.0,
               guidance_scale=3.5, generator=torch.Generator("cpu").manual_seed(3))
    assert int(np.abs(decoded(result.data[0].b64_json).astype(int) - ref.astype(int)).max()) <= 1


def refused(client, body: dict) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(prompt="a cat", size="64x64", extra_body={"num_inference_steps": 2, **body})
    return err.value


def test_what_a_family_cannot_take_is_a_400_naming_the_field_and_what_to_send(client, family):
    low = refused(client, {"true_cfg_scale": 0.5, "negative_prompt": "x"})          # the edge: no silent no-op
    assert low.body["param"] == "true_cfg_scale" and "greater than or equal to 1" in low.body["message"]
    if family == "flux":
        err = refused(client, {"negative_prompt": "blurry"})
        assert err.body["param"] == "negative_prompt" and "send true_cfg_scale > 1 with it" in err.body["message"]
        err = refused(client, {"true_cfg_scale": 4.0})
        assert err.body["param"] == "true_cfg_scale" and "send negative_prompt with it" in err.body["message"]
    else:
        err = refused(client, {"true_cfg_scale": 4.0, "negative_prompt": "blurry"})
        assert err.body["param"] == "true_cfg_scale" and "send guidance_scale" in err.body["message"]
