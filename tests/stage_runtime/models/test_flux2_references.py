"""FLUX.2 reference images (multi-reference editing: ``Flux2Pipeline(image=[...])``, Klein likewise) through the real
engine: each reference resized, cropped and VAE-encoded as ``__call__`` does, its tokens after the image's in every
forward with their own position ids. A request with two references of different sizes equals the bare pipeline with
the same seed (request mode within 1 uint8, step mode 2); a generation admitted beside it runs in forwards of its own
(the references' sizes are in both keys) and equals its bare call; without a size the image takes the first
reference's."""

from __future__ import annotations

import numpy as np
import pytest
from engine_probes import count_denoiser_calls, max_diff
from family_checks import bare_pipeline, generators, make_engine, reference_image, to_uint8
from PIL import Image

from stage_runtime.request import DiffusionRequest, EditInput, SamplingParams

STEPS, PROMPT = 3, "the cat from the first picture in the room of the second"
GUIDANCE = {"flux2": 4.0, "flux2-klein": 4.0}


def references() -> list[np.ndarray]:
    first = reference_image(64)
    second = np.asarray(Image.fromarray(reference_image(80)[:, ::-1].copy()).resize((96, 72)))   # 96 wide, 72 high
    return [first, np.ascontiguousarray(second)]


def bare(path: str, seed: int, guidance: float, pictures: list[np.ndarray] | None, size: int | None = 64):
    pipe = bare_pipeline(path)
    images = None if pictures is None else [Image.fromarray(p, "RGB") for p in pictures]
    sized = {} if size is None else {"height": size, "width": size}
    out = pipe(prompt=PROMPT, image=images, guidance_scale=guidance, num_inference_steps=STEPS,
               generator=generators(seed, 1), output_type="np", **sized)
    return to_uint8(out.images)


def edit(rid: str, seed: int, guidance: float, size: int | None = 64) -> DiffusionRequest:
    first, *more = references()
    sized = {} if size is None else {"height": size, "width": size}
    return DiffusionRequest(rid, PROMPT, SamplingParams(num_inference_steps=STEPS, seed=seed, guidance_scale=guidance,
                                                        **sized), edit=EditInput(first, more_images=tuple(more)))


@pytest.mark.parametrize("kind, mode", [("flux2", "request"), ("flux2", "step"), ("flux2-klein", "step")])
def test_references_equal_the_pipelines_own_call_and_a_generation_beside_them_runs_apart(kind, mode, tiny_model):
    path, guidance = tiny_model(kind), GUIDANCE[kind]
    engine = make_engine(path, mode, warmup=False, max_num_seqs=2, request_batch_max_wait_ms=200)
    calls = count_denoiser_calls(engine)
    try:
        with engine._lock:
            edited = engine.add_request(edit("edit", 1, guidance))
            plain = engine.add_request(DiffusionRequest("plain", PROMPT, SamplingParams(
                num_inference_steps=STEPS, seed=2, guidance_scale=guidance, height=64, width=64)))
        got = {"edit": edited.result(timeout=120).images, "plain": plain.result(timeout=120).images}
    finally:
        engine.close()
    tolerance = 1 if mode == "request" else 2
    assert max_diff(got["edit"], bare(path, 1, guidance, references())) <= tolerance
    assert max_diff(got["plain"], bare(path, 2, guidance, None)) <= tolerance
    assert max_diff(got["edit"], bare(path, 1, guidance, None)) > 5, "the references condition the image"
    assert calls[0] == 2 * STEPS, "an edit and a generation never share a forward (the sequence differs)"


def test_without_a_size_the_image_takes_the_first_references(tiny_flux2_path):
    engine = make_engine(tiny_flux2_path, "request", warmup=False)
    try:
        out = engine.add_request(edit("e", 3, 4.0, size=None)).result(timeout=120).images
    finally:
        engine.close()
    assert out.shape[1:3] == (64, 64)
    assert max_diff(out, bare(tiny_flux2_path, 3, 4.0, references(), size=None)) <= 1
