"""Requests: sampling validation at the edge, seed assignment, resolution against the model."""

from __future__ import annotations

import numpy as np
import pytest

from support.factories import model_info

from stage_runtime.errors import InvalidRequestError
from stage_runtime.request import DiffusionRequest, EditInput, RequestStatus, SamplingParams

INFO = model_info()


def test_seed_assigned_at_creation_and_kept():
    r = DiffusionRequest("a", "p")
    assert r.sampling.seed is not None
    assert r.resolve(INFO).sampling.seed == r.sampling.seed
    assert DiffusionRequest("b", "p", SamplingParams(seed=5)).sampling.seed == 5


def test_resolve_fills_defaults():
    r = DiffusionRequest("a", "p", SamplingParams(guidance_scale=0.0)).resolve(INFO)
    s = r.sampling
    assert (s.height, s.width, s.num_inference_steps, s.guidance_scale) == (64, 64, 20, 0.0)


@pytest.mark.parametrize("data, field", [
    ({"num_inference_steps": 0}, "num_inference_steps"),
    ({"height": 4}, "height"),
    ({"guidance_scale": float("nan")}, "guidance_scale"),
    ({"num_outputs": 17}, "num_outputs"),
    ({"seed": -1}, "seed"),
    ({"bogus": 1}, "bogus"),
])
def test_bad_sampling_names_the_field(data, field):
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams.parse(data)
    assert exc.value.field == field and field in str(exc.value)


def test_size_checks_against_model():
    with pytest.raises(InvalidRequestError, match="width=60.*multiple of 8"):
        DiffusionRequest("a", "p", SamplingParams(width=60)).resolve(INFO)
    fixed = model_info(pipeline_class="DiTPipeline", default_guidance=4.0, fixed_size=True)
    with pytest.raises(InvalidRequestError, match="height=96.*only serves 64x64"):
        DiffusionRequest("a", "p", SamplingParams(height=96)).resolve(fixed)


@pytest.mark.parametrize("rid", ["", None])
def test_request_id_required(rid):
    with pytest.raises(InvalidRequestError, match="request_id"):
        DiffusionRequest(rid, "p")


def test_prompt_length_bounded():
    with pytest.raises(InvalidRequestError, match="prompt"):
        DiffusionRequest("a", "x" * 5000)


def test_terminal_states():
    assert [s.finished for s in RequestStatus] == [False, False, True, True, True, False]   # PREEMPTED last


def test_steps_beyond_the_noise_schedulers_limit_are_refused_at_admission():
    limited = model_info(max_steps=999)
    resolved = DiffusionRequest("a", "p", SamplingParams(num_inference_steps=999)).resolve(limited)
    assert resolved.sampling.num_inference_steps == 999 and resolved.num_steps == 999
    with pytest.raises(InvalidRequestError, match=r"num_inference_steps=1000: .*at most 999 steps") as exc:
        DiffusionRequest("a", "p", SamplingParams(num_inference_steps=1000)).resolve(limited)
    assert exc.value.field == "num_inference_steps"


def test_family_compatibility_keys_come_from_model_info():
    """A family narrows the step key (FLUX/SD3: size only) through ModelInfo; the default keeps guidance."""
    family = model_info(pipeline_class="FluxPipeline", step_key=("height", "width"))
    a = DiffusionRequest("a", "p", SamplingParams(num_inference_steps=3, guidance_scale=2.0))
    b = DiffusionRequest("b", "p", SamplingParams(num_inference_steps=9, guidance_scale=5.0))
    assert a.resolve(family).step_key == b.resolve(family).step_key == (("height", 64), ("width", 64))
    assert a.resolve(family).batch_key != b.resolve(family).batch_key          # one call: one step count
    assert a.resolve(INFO).step_key != b.resolve(INFO).step_key                # default: guidance must match
    assert a.resolve(INFO).step_key == (64, 64, 2.0)


@pytest.mark.parametrize("rule, strength, steps", [("int", 0.55, 5), ("flow", 0.55, 6), ("int", None, 8),
                                                   ("flow", 1.0, 10), ("int", 0.05, 0)])
def test_an_edits_step_count_follows_its_familys_rule(rule, strength, steps):
    info = model_info(edit_tasks=("img2img",), edit_step_rule=rule)
    edit = EditInput(np.zeros((64, 64, 3), np.uint8), None, strength).resolve(info)
    assert edit.task == "img2img" and edit.strength == (0.8 if strength is None else strength)
    assert edit.denoise_steps(10) == steps


def test_a_maskless_edit_on_an_instruction_edit_family_is_an_instruction_edit():
    image = np.zeros((64, 64, 3), np.uint8)
    kontext = model_info(pipeline_class="FluxKontextPipeline", edit_tasks=("instruct",), step_key=("height", "task"))
    request = DiffusionRequest("e", "make it blue", SamplingParams(num_inference_steps=7), edit=EditInput(image))
    resolved = request.resolve(kontext)
    assert resolved.task == "instruct" and resolved.num_steps == 7 and resolved.edit.strength is None
    assert resolved.step_key == (("height", 64), ("task", "instruct"))
    assert DiffusionRequest("g", "x").resolve(kontext).step_key == (("height", 64), ("task", "generate"))
    with pytest.raises(InvalidRequestError, match="no strength") as err:
        DiffusionRequest("s", "x", edit=EditInput(image, None, 0.5)).resolve(kontext)
    assert err.value.field == "strength"
    with pytest.raises(InvalidRequestError, match="does not serve inpaint edits") as err:
        DiffusionRequest("m", "x", edit=EditInput(image, np.zeros((64, 64), np.uint8))).resolve(kontext)
    assert err.value.field == "mask"
