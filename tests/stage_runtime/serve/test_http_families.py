"""Each new family served by a real stage process over HTTP: SSE progress arrives in order, then one
completed event whose PNG equals the bare diffusers call (step mode <= 2 uint8, request mode <= 1); the
stage drains to exit 0 and leaves nothing behind. Qwen-Image and Z-Image run in step mode, FLUX.2 [klein] in
request mode (its own step loop: progress from its one forward per step; and its multi-reference edits through the
SDK), the generic adapter
(StableDiffusionPAGPipeline) in request mode with progress from callback_on_step_end: the two progress
mechanisms the new families add. (SDXL's progress is SD's — a UNet forward per step — and its engine-level
stream order is checked in tests/stage_runtime/models/test_sdxl.py; a stage process costs ~10-30 s here.)"""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
import torch
from engine_probes import phased
from family_checks import bare_pipeline, generators, reference_image, to_uint8
from PIL import Image
from serve_probes import decode_png, sse_events
from stage_process import StageProcess

from stage_runtime.imageio import encode_png

torch.set_num_threads(1)
STEPS, SEED = 5, 21


def bare_qwen(pipe):
    return pipe(prompt="a red fox", negative_prompt=" ", true_cfg_scale=4.0, num_inference_steps=STEPS, height=64,
                width=64, generator=generators(SEED, 1), output_type="np").images


def bare_pag(pipe):
    return pipe(prompt=["a red fox"], negative_prompt=[""], num_inference_steps=STEPS, guidance_scale=7.5,
                height=64, width=64, generator=generators(SEED, 1), output_type="np").images


def bare_zimage(pipe):
    return pipe(prompt=["a red fox"], num_inference_steps=STEPS, guidance_scale=3.0, height=64, width=64,
                generator=generators(SEED, 1), output_type="np").images


def bare_flux2_klein(pipe):
    return pipe(prompt="a red fox", guidance_scale=4.0, num_inference_steps=STEPS, height=64, width=64,
                generator=generators(SEED, 1), output_type="np").images


def check_reference_images(stage: StageProcess, path: str) -> None:
    """FLUX.2's multi-reference editing through the OpenAI SDK: ``images.edit`` with two pictures (``image[]`` twice)
    equals ``pipe(image=[first, second])``; an eleventh picture is a 400 naming ``image[10]``."""
    pictures = [reference_image(64), np.ascontiguousarray(reference_image(80)[:, ::-1])]
    files = [(f"ref{k}.png", encode_png(p), "image/png") for k, p in enumerate(pictures)]
    with openai.OpenAI(base_url=f"{stage.http_url}/v1", api_key="none", max_retries=0, timeout=120) as client:
        edited = client.images.edit(image=files, prompt="the fox of the first in the second", size="64x64",
                                    extra_body={"num_inference_steps": STEPS, "seed": SEED, "guidance_scale": 4.0})
        with pytest.raises(openai.BadRequestError) as too_many:
            client.images.edit(image=files * 5 + files[:1], prompt="x", size="64x64")
    bare = bare_pipeline(path)(prompt="the fox of the first in the second",
                               image=[Image.fromarray(p) for p in pictures], guidance_scale=4.0,
                               num_inference_steps=STEPS, height=64, width=64, generator=generators(SEED, 1),
                               output_type="np").images
    got = decode_png(edited.data[0].b64_json)
    assert int(np.abs(got.astype(int) - to_uint8(bare)[0].astype(int)).max()) <= 1
    assert too_many.value.body["param"] == "image[10]", too_many.value.body


# family → (path fixture, execution mode, guidance, bare call, tolerance)
FAMILIES = {"qwen-image": ("tiny_qwen_image_path", "step", 4.0, bare_qwen, 2),
            "zimage": ("tiny_zimage_path", "step", 3.0, bare_zimage, 2),
            "flux2-klein": ("tiny_flux2_klein_path", "request", 4.0, bare_flux2_klein, 1),
            "generic-pag": ("tiny_pag_path", "request", 7.5, bare_pag, 1)}


@pytest.mark.parametrize("family", FAMILIES)
def test_sse_progress_in_order_and_the_image_equals_diffusers(request, tmp_path, family):
    fixture, mode, guidance, bare, tolerance = FAMILIES[family]
    path = request.getfixturevalue(fixture)
    config = tmp_path / "stage.yaml"
    config.write_text("warmup: false\n")            # warmup runs at the default size (512 px for Qwen-Image)
    stage = StageProcess(["--model", path, "--config", str(config), "--device", "cpu", "--executor", "uni",
                          "--execution-mode", mode], tmp_path / "stage.log")
    try:
        stage.start()
        body = {"prompt": "a red fox", "num_inference_steps": STEPS, "seed": SEED, "stream": True,
                "guidance_scale": guidance, "size": "64x64", "stream_format": "diffstage"}   # progress events
        with httpx.Client(base_url=stage.http_url, timeout=120) as http:
            with http.stream("POST", "/v1/images/generations", json=body) as resp:
                assert resp.status_code == 200
                events = sse_events(resp.read().decode())
        assert [(d["phase"], d["step"]) for kind, d in events if kind == "progress"] == phased(STEPS)
        assert [kind for kind, _ in events].count("completed") == 1 and events[-1][0] == "completed"
        image = decode_png(events[-1][1]["data"][0]["b64_json"])
        reference = to_uint8(bare(bare_pipeline(path)))[0]
        assert int(np.abs(image.astype(int) - reference.astype(int)).max()) <= tolerance
        if family == "flux2-klein":
            check_reference_images(stage, path)
        assert stage.stop() == 0, stage.log[-3000:]
        stage.assert_no_leaks()
        if family == "generic-pag":
            assert "StableDiffusionPAGPipeline is served by the generic diffusers adapter" in stage.log
    finally:
        stage.kill()
