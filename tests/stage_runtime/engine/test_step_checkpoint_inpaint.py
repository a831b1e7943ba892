"""Step checkpoints of the new step states: a FLUX.1 inpaint with true CFG (its mask, image latents and noise in the
state's ``edit``, the negative prompt's embeddings in ``cond``) and an SDXL inpaint, each checkpointed mid-run and
resumed on ANOTHER engine to the very image of the uninterrupted run; a checkpoint resumed with another
``true_cfg_scale`` is refused naming ``resume_from``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from engine_probes import assert_nothing_left, count_denoiser_calls, threadless

from stage_runtime.errors import InvalidRequestError
from stage_runtime.request import DiffusionRequest, EditInput, SamplingParams

SIZE, STEPS, AT = 64, 8, 3


def inpaint(rid: str, **sampling) -> DiffusionRequest:
    y, x = np.mgrid[0:SIZE, 0:SIZE] / SIZE
    image = ((np.stack([np.sin(6 * x), np.cos(5 * y), x * y], -1) + 1) * 127).astype(np.uint8)
    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[16:48, 8:40] = 255
    return DiffusionRequest(rid, "a red fox", SamplingParams(num_inference_steps=STEPS, seed=7, **sampling),
                            edit=EditInput(image, mask, 0.9))


def run_to_end(engine, stream):
    while not stream.finished:
        assert engine.step()
    return stream.result(timeout=0)


@pytest.mark.parametrize(("fixture", "sampling"), [
    ("tiny_flux_path", {"negative_prompt": "blurry", "true_cfg_scale": 4.0}),
    ("tiny_sdxl_path", {"negative_prompt": "blurry"}),
], ids=["flux-true-cfg", "sdxl"])
def test_an_inpaint_resumed_on_another_engine_makes_the_same_image(request, tmp_path, fixture, sampling):
    model = request.getfixturevalue(fixture)
    path = str(tmp_path / "inpaint.safetensors")
    first, second = threadless(model), threadless(model)
    try:
        stream = first.add_request(inpaint("A", **sampling))
        for _ in range(AT):
            first.step()
        [saved] = first.collective_rpc("checkpoint_request", ("A", path))
        assert saved["step"] == AT
        uninterrupted = run_to_end(first, stream).images
        calls = count_denoiser_calls(second)
        total = second.check_request(inpaint("B", **sampling)).num_steps        # the family's count for the strength
        out = run_to_end(second, second.add_request(dataclasses.replace(inpaint("B", **sampling), resume_from=path)))
        assert out.ok and calls[0] == total - AT and np.array_equal(out.images, uninterrupted)     # bitwise
        if "true_cfg_scale" in sampling:
            other = dataclasses.replace(inpaint("C", negative_prompt="blurry", true_cfg_scale=2.0), resume_from=path)
            with pytest.raises(InvalidRequestError) as refused:
                second.add_request(other)
            assert refused.value.field == "resume_from" and "true_cfg_scale=4.0" in str(refused.value)
        assert_nothing_left(second)
    finally:
        first.close()
        second.close()
