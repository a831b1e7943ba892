"""The official ``openai`` SDK against Qwen-Image-Edit stage processes: ``images.edit`` with one picture (Edit,
step mode, the stage warmed up with an edit) and with a list of pictures (Edit-Plus, request mode: the SDK sends
``image[]`` repeated), each equal to the bare diffusers pipeline; what they cannot do is a 400 naming the field."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
import torch
from family_checks import bare_pipeline, edit_pictures, generators, to_uint8
from PIL import Image
from stage_process import running_stage

from stage_runtime.models.families.qwen_vl_processor import load_processor

torch.set_num_threads(1)
STEPS = 3
EXTRA = {"num_inference_steps": STEPS, "seed": 5, "guidance_scale": 4.0}


@pytest.fixture(scope="module")
def edit_client(tiny_qwen_image_edit_path, tmp_path_factory):
    """A Qwen-Image-Edit stage in step mode, with its warmup (a grey 1024x1024 picture's edit)."""
    tmp = tmp_path_factory.mktemp("qwen-edit-stage")
    with running_stage(["--model", tiny_qwen_image_edit_path, "--served-name", "tiny-qwen-edit", "--device", "cpu",
                        "--executor", "uni", "--execution-mode", "step", "--max-num-seqs", "2"],
                       tmp / "stage.log", ready_timeout=600) as stage:     # the warmup: a megapixel edit on a CPU
        with openai.OpenAI(base_url=f"{stage.http_url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
            yield client


@pytest.fixture(scope="module")
def plus_client(tiny_qwen_image_edit_plus_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwen-edit-plus-stage")
    config = tmp / "stage.yaml"
    config.write_text("warmup: false\n")
    with running_stage(["--config", str(config), "--model", tiny_qwen_image_edit_plus_path, "--device", "cpu",
                        "--executor", "uni", "--max-num-seqs", "2"], tmp / "stage.log") as stage:
        with openai.OpenAI(base_url=f"{stage.http_url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
            yield client


def png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def decoded(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def bare(path: str, prompt: str, pictures: list[np.ndarray], plus: bool) -> np.ndarray:
    images = [Image.fromarray(p, "RGB") for p in pictures]
    pipe = bare_pipeline(path, processor=load_processor(path))
    out = pipe(image=images if plus else images[0], prompt=prompt, negative_prompt=" ", true_cfg_scale=4.0,
               height=64, width=64, num_inference_steps=STEPS, generator=generators(5, 1), output_type="np")
    return to_uint8(out.images)[0]


def diff(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


def test_edit_of_one_picture_is_the_bare_pipeline(edit_client, tiny_qwen_image_edit_path):
    facts = edit_client.models.list().data[0].diffstage
    assert facts["pipeline_class"] == "QwenImageEditPipeline" and facts["edit_tasks"] == ["instruct"]
    assert facts["edits_only"] and facts["max_edit_images"] == 1 and facts["guidance"] == "true_cfg"
    (picture,) = edit_pictures((64,))
    result = edit_client.images.edit(image=("in.png", png(picture), "image/png"), prompt="make it blue", size="auto",
                                     extra_body=EXTRA)
    image = decoded(result.data[0].b64_json)
    assert image.shape == (64, 64, 3)
    assert diff(image, bare(tiny_qwen_image_edit_path, "make it blue", [picture], plus=False)) <= 2


def test_what_qwen_image_edit_cannot_do_is_refused_naming_the_field(edit_client):
    (picture,) = edit_pictures((64,))
    with pytest.raises(openai.BadRequestError, match="one image per request") as err:
        edit_client.images.edit(image=[("a.png", png(picture), "image/png"), ("b.png", png(picture), "image/png")],
                                prompt="x", extra_body=EXTRA)
    assert err.value.body["param"] == "image[1]"
    with pytest.raises(openai.BadRequestError, match="at most 16 images") as err:     # the edge reads no more
        edit_client.images.edit(image=[(f"{i}.png", png(picture), "image/png") for i in range(17)], prompt="x",
                                extra_body=EXTRA)
    assert err.value.body["param"] == "image[16]"
    with pytest.raises(openai.BadRequestError, match="POST /v1/images/edits") as err:
        edit_client.images.generate(prompt="a red fox", size="64x64", extra_body=EXTRA)
    assert err.value.body["param"] == "image"


def test_edit_plus_takes_the_sdk_list_of_pictures_in_order(plus_client, tiny_qwen_image_edit_plus_path):
    facts = plus_client.models.list().data[0].diffstage
    assert facts["pipeline_class"] == "QwenImageEditPlusPipeline" and facts["max_edit_images"] == 4
    pictures = edit_pictures((64, 48))
    result = plus_client.images.edit(image=[(f"{i}.png", png(p), "image/png") for i, p in enumerate(pictures)],
                                     prompt="put them together", extra_body=EXTRA)
    image = decoded(result.data[0].b64_json)
    assert image.shape == (64, 64, 3)                        # size auto: the first picture's
    path = tiny_qwen_image_edit_plus_path
    assert diff(image, bare(path, "put them together", pictures, plus=True)) <= 1
    assert diff(image, bare(path, "put them together", pictures[:1], plus=True)) > 20      # both pictures came
    assert diff(image, bare(path, "put them together", pictures[::-1], plus=True)) > 2      # in upload order
    with pytest.raises(openai.BadRequestError, match="at most 4 images") as err:
        plus_client.images.edit(image=[(f"{i}.png", png(pictures[0]), "image/png") for i in range(5)], prompt="x",
                                extra_body=EXTRA)
    assert err.value.body["param"] == "image[4]"
