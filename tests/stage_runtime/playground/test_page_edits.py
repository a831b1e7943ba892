"""The playground's edit path in a real headless Chromium against a real tiny SD stage (img2img and inpainting): the
form offers an image upload, a mask and size ``auto``; an uploaded image (and mask) goes to ``/v1/images/edits`` as
multipart, and the card shows the image the stage answers to the same form sent by a plain HTTP client."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
from stage_process import running_stage

from stage_runtime.imageio import decode_image, encode_png
from support.browser import chromium, image_of, open_page

SIZE = 64


@pytest.fixture(scope="module")
def browser():
    with chromium() as launched:
        yield launched


@pytest.fixture(scope="module")
def sd_stage(browser, tiny_sd_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("playground-sd")
    with running_stage(["--model", tiny_sd_path, "--device", "cpu", "--executor", "uni", "--execution-mode", "step"],
                       folder / "stage.log") as stage:
        yield stage


def picture(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return encode_png(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))


def mask_png() -> bytes:
    mask = np.zeros((SIZE, SIZE, 3), np.uint8)
    mask[16:48, 16:48] = 255                                   # white: repaint
    return encode_png(mask)


@pytest.mark.parametrize("with_mask", [False, True], ids=["img2img", "inpaint"])
def test_an_uploaded_image_is_edited_as_the_api_edits_it(browser, sd_stage, with_mask):
    image = picture(1)
    with open_page(browser, f"{sd_stage.http_url}/") as (page, watch):
        page.wait_for_selector("body[data-ready='1']")
        assert page.is_visible("#image") and page.is_visible("#mask")
        assert page.eval_on_selector("#size", "s => s.options[0].value") == "auto"
        page.fill("#prompt", "a watercolour cat")
        page.select_option("#size", "auto")
        page.fill("#steps", "4")
        page.fill("#seed", "7")
        page.set_input_files("#image", files=[{"name": "cat.png", "mimeType": "image/png", "buffer": image}])
        if with_mask:
            page.set_input_files("#mask", files=[{"name": "mask.png", "mimeType": "image/png", "buffer": mask_png()}])
        page.click("#generate")
        page.wait_for_selector(".card[data-kind='edit'][data-state='completed'] img[data-final]", timeout=120_000)
        drawn = image_of(page, ".card img[data-final]")
        guidance = page.input_value("#guidance")
    files = {"image": ("cat.png", image, "image/png")}
    if with_mask:
        files["mask"] = ("mask.png", mask_png(), "image/png")
    answer = httpx.post(f"{sd_stage.http_url}/v1/images/edits", timeout=120, files=files, data={
        "prompt": "a watercolour cat", "size": "auto", "num_inference_steps": "4", "seed": "7", "n": "1",
        "guidance_scale": guidance})
    assert answer.status_code == 200, answer.text
    expected = decode_image(base64.b64decode(answer.json()["data"][0]["b64_json"]), "image", 1 << 20)
    assert drawn.shape == (SIZE, SIZE, 3)
    assert np.abs(drawn.astype(int) - expected.astype(int)).max() <= 1
