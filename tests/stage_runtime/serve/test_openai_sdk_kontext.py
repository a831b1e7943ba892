"""The official ``openai`` SDK against one FLUX.1 Kontext stage process (step mode): ``images.edit`` is an
instruction edit equal to the bare FluxKontextPipeline call, streamed edits parse, generations work, and the
edge refuses what Kontext cannot do (a mask: inpaint; a strength) with 400 naming the field."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
import torch
from diffusers import FluxKontextPipeline
from PIL import Image
from stage_process import running_stage

STEPS = 4


@pytest.fixture(scope="module")
def kontext_stage(tiny_flux_kontext_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kontext-stage")
    with running_stage(["--model", tiny_flux_kontext_path, "--served-name", "tiny-kontext", "--device", "cpu",
                        "--executor", "uni", "--execution-mode", "step", "--max-num-seqs", "2"],
                       tmp / "stage.log") as stage:
        yield stage


@pytest.fixture
def client(kontext_stage):
    with openai.OpenAI(base_url=f"{kontext_stage.http_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def png(array: np.ndarray, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array, mode).save(buf, format="PNG")
    return buf.getvalue()


def picture(side: int = 64) -> np.ndarray:
    y, x = np.mgrid[0:side, 0:side] / side
    return ((np.stack([np.sin(6 * x), np.cos(5 * y), x * y], -1) + 1) * 127).astype(np.uint8)


def decoded(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def test_models_list_says_kontext_runs_instruction_edits(client):
    facts = client.models.list().data[0].diffstage
    assert facts["pipeline_class"] == "FluxKontextPipeline" and facts["edit_tasks"] == ["instruct"]
    assert facts["supports_edits"] and facts["guidance"] == "distilled"


def test_edit_is_the_bare_kontext_instruction_edit(client, tiny_flux_kontext_path):
    result = client.images.edit(image=("in.png", png(picture()), "image/png"), prompt="make it blue", size="auto",
                                extra_body={"num_inference_steps": STEPS, "seed": 5, "guidance_scale": 3.5})
    pipe = FluxKontextPipeline.from_pretrained(tiny_flux_kontext_path, local_files_only=True, low_cpu_mem_usage=False)
    pipe.set_progress_bar_config(disable=True)
    ref = pipe(image=Image.fromarray(picture()), prompt="make it blue", height=64, width=64, max_area=64 * 64,
               _auto_resize=False, num_inference_steps=STEPS, guidance_scale=3.5, output_type="np",
               generator=torch.Generator("cpu").manual_seed(5)).images
    ref = (ref * 255).round().clip(0, 255).astype(np.uint8)[0]
    image = decoded(result.data[0].b64_json)
    assert image.shape == (64, 64, 3)
    assert int(np.abs(image.astype(int) - ref.astype(int)).max()) <= 2


def test_streamed_edit_yields_the_sdk_edit_events(client):
    events = list(client.images.edit(image=("in.png", png(picture()), "image/png"), prompt="make it blue",
                                     stream=True, partial_images=1, extra_body={"num_inference_steps": STEPS}))
    kinds = [e.type for e in events]
    assert kinds.count("image_edit.partial_image") == 1 and kinds[-1] == "image_edit.completed"
    assert decoded(events[-1].b64_json).shape == (64, 64, 3)


def test_generations_are_served_too(client):
    result = client.images.generate(prompt="a red fox", size="64x64", extra_body={"num_inference_steps": STEPS})
    assert decoded(result.data[0].b64_json).shape == (64, 64, 3)


def test_what_kontext_cannot_do_is_refused_naming_the_field(client):
    alpha = np.zeros((64, 64), np.uint8)
    with pytest.raises(openai.BadRequestError, match="inpaint") as err:
        client.images.edit(image=("in.png", png(picture()), "image/png"), prompt="x",
                           mask=("mask.png", png(np.dstack([picture(), alpha]), "RGBA"), "image/png"),
                           extra_body={"num_inference_steps": STEPS})
    assert err.value.body["param"] == "mask"
    with pytest.raises(openai.BadRequestError, match="no strength") as err:
        client.images.edit(image=("in.png", png(picture()), "image/png"), prompt="x",
                           extra_body={"num_inference_steps": STEPS, "strength": 0.5})
    assert err.value.body["param"] == "strength"
