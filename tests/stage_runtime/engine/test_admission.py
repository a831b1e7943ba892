"""Admission, family by family: every request a family cannot take is an InvalidRequestError naming the field
and the value before it is queued (``engine.admission.admit``: the model's facts, the mode, then the serving
adapter class's ``check_request``, from the torch-free class ``ModelInfo.refusals`` names). No worker runs
here: a refusal needs none. Each family's ModelInfo carries the facts its adapter reports (the size multiples
as the released models have them); tests/stage_runtime/models/ pin them against the loaded tiny adapters. The
requests each family must still take are checked too, so no refusal here is wider than the family."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from support.factories import model_info

from stage_runtime.engine.admission import admit, family_check
from stage_runtime.errors import InvalidRequestError
from stage_runtime.request import DiffusionRequest, EditInput, SamplingParams

M = "stage_runtime.models"
DIT, GENERIC = f"{M}.refusals:DiTRefusals", f"{M}.refusals:GenericRefusals"
FAMILIES = {
    "sd": model_info(edit_tasks=("img2img", "inpaint"), lora_components=("unet", "text_encoder")),
    "sdxl": model_info(pipeline_class="StableDiffusionXLPipeline", adapter=f"{M}.sdxl:StableDiffusionXLAdapter",
                       default_guidance=5.0, edit_tasks=("img2img", "inpaint")),
    "sd3": model_info(pipeline_class="StableDiffusion3Pipeline", adapter=f"{M}.sd3:StableDiffusion3Adapter",
                      default_guidance=7.0, size_multiple=16),
    "flux": model_info(pipeline_class="FluxPipeline", adapter=f"{M}.flux:FluxAdapter", default_guidance=3.5,
                       size_multiple=16, guidance="distilled", edit_tasks=("img2img", "inpaint"), edit_step_rule="flow",
                       true_cfg=True),
    "flux-schnell": model_info(pipeline_class="FluxPipeline", adapter=f"{M}.flux:FluxAdapter", default_steps=4,
                               default_guidance=0.0, size_multiple=16, guidance="none",
                               edit_tasks=("img2img", "inpaint"), true_cfg=True),
    "flux-kontext": model_info(pipeline_class="FluxKontextPipeline", adapter=f"{M}.flux_kontext:FluxKontextAdapter",
                               default_guidance=3.5, size_multiple=16, guidance="distilled", edit_tasks=("instruct",),
                               true_cfg=True),
    "flux2": model_info(pipeline_class="Flux2Pipeline", adapter=f"{M}.flux2:Flux2Adapter", default_steps=50,
                        default_guidance=4.0, size_multiple=16, guidance="distilled", edit_tasks=("instruct",),
                        max_edit_images=10, refusals=f"{M}.refusals:Flux2Refusals"),
    "flux2-klein": model_info(pipeline_class="Flux2KleinPipeline", adapter=f"{M}.flux2_klein:Flux2KleinAdapter",
                              default_steps=50, default_guidance=4.0, size_multiple=16, edit_tasks=("instruct",),
                              max_edit_images=10, refusals=f"{M}.refusals:Flux2Refusals"),
    "flux2-klein-distilled": model_info(pipeline_class="Flux2KleinPipeline",
                                        adapter=f"{M}.flux2_klein:Flux2KleinAdapter", default_steps=4,
                                        default_guidance=1.0, size_multiple=16, guidance="none"),
    "qwen-image": model_info(pipeline_class="QwenImagePipeline", adapter=f"{M}.qwen_image:QwenImageAdapter",
                             default_guidance=4.0, size_multiple=16, guidance="true_cfg"),
    "zimage": model_info(pipeline_class="ZImagePipeline", adapter=f"{M}.zimage:ZImageAdapter", default_steps=50,
                         default_guidance=5.0, size_multiple=16, refusals=f"{M}.refusals:ZImageRefusals"),
    "dit": model_info(pipeline_class="DiTPipeline", adapter=f"{M}.dit:DiTAdapter", default_guidance=4.0,
                      fixed_size=True, max_sequence_length=None, num_classes=1000, refusals=DIT,
                      class_labels=(("goldfish", 1), ("tench", 0))),
    # The generic adapter over a pipeline whose __call__ takes a prompt, a size and a step count only, one
    # image per call (no lists, no num_images_per_prompt).
    "generic-bare": model_info(pipeline_class="SomeBarePipeline", adapter=f"{M}.generic:GenericDiffusersAdapter",
                               default_guidance=1.0, supports_request_batch=False, supports_step_execution=False,
                               refusals=GENERIC,
                               call_params=("prompt", "height", "width", "num_inference_steps")),
    "generic-pag": model_info(pipeline_class="StableDiffusionPAGPipeline",
                              adapter=f"{M}.generic:GenericDiffusersAdapter", default_steps=50, refusals=GENERIC,
                              supports_step_execution=False, call_params=(
                                  "prompt", "negative_prompt", "height", "width", "num_inference_steps",
                                  "guidance_scale", "num_images_per_prompt")),
}
IMAGE, MASK = np.zeros((64, 64, 3), np.uint8), np.zeros((64, 64), np.uint8)


def request(prompt: str = "a cat", edit: EditInput | None = None, **sampling) -> DiffusionRequest:
    return DiffusionRequest("r", prompt, SamplingParams(**sampling), edit=edit)


def admitted(family: str, req: DiffusionRequest, mode: str = "request") -> DiffusionRequest:
    info = FAMILIES[family]
    return admit(req, info, mode, family_check(info))


# family, request, the field named, the value as the message shows it
REFUSED = [
    ("flux", request(negative_prompt="blurry"), "negative_prompt", "'blurry'"),
    ("flux", request(edit=EditInput(IMAGE), negative_prompt="blurry"), "negative_prompt", "'blurry'"),
    ("flux-schnell", request(negative_prompt="blurry"), "negative_prompt", "'blurry'"),
    ("flux-schnell", request(guidance_scale=3.5), "guidance_scale", "3.5"),
    ("flux-kontext", request(negative_prompt="blurry"), "negative_prompt", "'blurry'"),
    ("flux-kontext", request(edit=EditInput(IMAGE, None, 0.5)), "strength", "0.5"),
    ("flux-kontext", request(edit=EditInput(IMAGE, MASK)), "mask", "'<upload>'"),
    ("flux", request(true_cfg_scale=4.0), "true_cfg_scale", "4.0"),           # no negative prompt: ignored
    ("flux", request(negative_prompt="blurry", true_cfg_scale=1.0), "negative_prompt", "'blurry'"),
    ("flux-kontext", request(true_cfg_scale=2.0, edit=EditInput(IMAGE)), "true_cfg_scale", "2.0"),
    ("flux", request(height=72), "height", "72"),
    ("flux-kontext", request(width=40), "width", "40"),
    ("flux2", request(negative_prompt="blurry"), "negative_prompt", "'blurry'"),
    ("flux2", request(edit=EditInput(IMAGE, MASK)), "mask", "'<upload>'"),
    ("flux2", request(edit=EditInput(IMAGE, more_images=(IMAGE[:40],))), "image[1]", "'64x40'"),
    ("flux2", request(edit=EditInput(IMAGE, more_images=(IMAGE,) * 10)), "image[10]", "'<file>'"),
    ("flux2", request(height=72), "height", "72"),
    ("flux2-klein", request(negative_prompt="blurry", guidance_scale=1.0), "negative_prompt", "'blurry'"),
    ("flux2-klein", request(edit=EditInput(IMAGE, MASK)), "mask", "'<upload>'"),
    ("flux2-klein-distilled", request(guidance_scale=4.0), "guidance_scale", "4.0"),
    ("flux2-klein-distilled", request(negative_prompt="blurry"), "negative_prompt", "'blurry'"),
    ("dit", request("1000"), "prompt", "'1000'"),
    ("dit", request(" 5000 "), "prompt", "' 5000 '"),
    ("dit", request("207", negative_prompt="blurry"), "negative_prompt", "'blurry'"),
    ("dit", request(height=96), "height", "96"),
    ("dit", request(edit=EditInput(IMAGE)), "image", "'<upload>'"),
    ("sd", request(negative_prompt="blurry", guidance_scale=1.0), "negative_prompt", "'blurry'"),
    ("sd", request(width=60), "width", "60"),
    ("sd", request(edit=EditInput(IMAGE, MASK[:32])), "mask", "'64x32'"),
    ("sdxl", request(negative_prompt="blurry", guidance_scale=0.5), "negative_prompt", "'blurry'"),
    ("sdxl", request(negative_prompt="blurry", true_cfg_scale=4.0), "true_cfg_scale", "4.0"),
    ("sd", request(negative_prompt="blurry", true_cfg_scale=4.0), "true_cfg_scale", "4.0"),
    ("qwen-image", request(negative_prompt="blurry", true_cfg_scale=4.0), "true_cfg_scale", "4.0"),
    ("dit", request("207", true_cfg_scale=2.0), "true_cfg_scale", "2.0"),
    ("generic-pag", request(negative_prompt="blurry", true_cfg_scale=2.0), "true_cfg_scale", "2.0"),
    ("sd3", request(negative_prompt="blurry", guidance_scale=1.0), "negative_prompt", "'blurry'"),
    ("sd3", request(height=72), "height", "72"),
    ("sd3", request(edit=EditInput(IMAGE)), "image", "'<upload>'"),
    ("qwen-image", request(negative_prompt="blurry", guidance_scale=1.0), "negative_prompt", "'blurry'"),
    ("qwen-image", request(width=72), "width", "72"),
    ("qwen-image", request(edit=EditInput(IMAGE)), "image", "'<upload>'"),
    ("zimage", request(negative_prompt="blurry", guidance_scale=0.0), "negative_prompt", "'blurry'"),
    ("zimage", request(height=72), "height", "72"),
    ("zimage", request(edit=EditInput(IMAGE)), "image", "'<upload>'"),
    ("generic-bare", request(negative_prompt="blurry"), "negative_prompt", "'blurry'"),
    ("generic-bare", request(guidance_scale=7.5), "guidance_scale", "7.5"),
    ("generic-bare", request(num_outputs=2), "num_outputs", "2"),
    ("generic-pag", request(edit=EditInput(IMAGE)), "image", "'<upload>'"),
    ("generic-pag", request(preview_every=1), "preview_every", "1"),
]


@pytest.mark.parametrize("family, req, field, shown", REFUSED,
                         ids=[f"{family}-{field}-{i}" for i, (family, _, field, _) in enumerate(REFUSED)])
def test_each_familys_refusal_names_the_field_and_the_value(family, req, field, shown):
    with pytest.raises(InvalidRequestError) as err:
        admitted(family, req)
    assert err.value.field == field and str(err.value).startswith(f"{field}={shown}: "), err.value


# What each family serves: its neighbours of the refusals above pass admission.
ACCEPTED = [
    ("flux", request(negative_prompt=""), {}),                   # "" is no negative prompt
    ("flux", request(guidance_scale=5.0, edit=EditInput(IMAGE)), {"guidance_scale": 5.0}),
    ("flux-schnell", request(guidance_scale=0.0), {"guidance_scale": 0.0}),
    ("flux-schnell", request(), {"guidance_scale": 0.0, "num_inference_steps": 4}),
    ("flux-kontext", request(edit=EditInput(IMAGE)), {}),
    ("flux2", request(guidance_scale=2.5), {"guidance_scale": 2.5, "num_inference_steps": 50}),
    ("flux2-klein", request(negative_prompt="blurry"), {"guidance_scale": 4.0}),
    ("flux2-klein", request(guidance_scale=1.0, width=80), {"width": 80}),
    ("flux2-klein-distilled", request(), {"guidance_scale": 1.0, "num_inference_steps": 4}),
    ("flux", request(negative_prompt="blurry", true_cfg_scale=4.0), {"true_cfg_scale": 4.0}),
    ("flux", request(negative_prompt="", true_cfg_scale=2.0), {"negative_prompt": ""}),   # as diffusers: "" is one
    ("flux", request(true_cfg_scale=1.0), {"true_cfg_scale": 1.0}),           # 1: off, diffusers' default
    ("flux", request(edit=EditInput(IMAGE, MASK), negative_prompt="blurry", true_cfg_scale=3.0), {}),
    ("flux-schnell", request(negative_prompt="blurry", true_cfg_scale=2.0), {"guidance_scale": 0.0}),
    ("flux-kontext", request(edit=EditInput(IMAGE), negative_prompt="blurry", true_cfg_scale=2.0), {}),
    ("sdxl", request(edit=EditInput(IMAGE, MASK)), {}),
    ("sd", request(true_cfg_scale=1.0), {}),
    ("dit", request("999"), {}),
    ("dit", request("tench"), {}),
    ("dit", request("a photo of a cat"), {}),                     # any other text: hashed to a class
    ("dit", request("²"), {}),                                    # a non-ASCII digit is text, not an id
    ("sd", request(negative_prompt="blurry", guidance_scale=1.5), {}),
    ("sd", request(edit=EditInput(IMAGE, MASK)), {}),
    ("sdxl", request(negative_prompt="blurry"), {"guidance_scale": 5.0}),
    ("sd3", request(negative_prompt="blurry", height=80), {"height": 80}),
    ("qwen-image", request(negative_prompt="blurry"), {"guidance_scale": 4.0}),
    ("qwen-image", request(guidance_scale=1.0), {}),
    ("zimage", request(negative_prompt="blurry", guidance_scale=0.5), {}),   # CFG at any scale > 0
    ("zimage", request(guidance_scale=0.0), {"num_inference_steps": 50}),
    ("generic-bare", request(guidance_scale=1.0, num_inference_steps=20, height=64), {}),
    ("generic-pag", request(negative_prompt="blurry", guidance_scale=3.0, num_outputs=2), {}),
]


@pytest.mark.parametrize("family, req, filled", ACCEPTED, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(ACCEPTED)])
def test_what_each_family_serves_is_admitted_resolved(family, req, filled):
    resolved = admitted(family, req)
    assert all(getattr(resolved.sampling, name) == value for name, value in filled.items()), resolved.sampling


def test_a_label_of_the_models_own_table_maps_within_range_and_an_out_of_range_label_is_refused():
    assert admitted("dit", request("goldfish")).prompt == "goldfish"
    broken = dataclasses.replace(FAMILIES["dit"], class_labels=(("ghost", 1000),))
    with pytest.raises(InvalidRequestError, match="prompt='ghost': class id must be < 1000") as err:
        admit(request("ghost"), broken, "request", family_check(broken))
    assert err.value.field == "prompt"


def test_previews_in_step_mode_pass():
    assert admitted("sd", request(preview_every=1), mode="step").sampling.preview_every == 1


def test_a_refused_true_cfg_field_says_what_to_send_instead():
    cases = [("flux", request(negative_prompt="blurry"), "send true_cfg_scale > 1 with it"),
             ("flux-schnell", request(negative_prompt="blurry"), "send true_cfg_scale > 1 with it"),
             ("flux", request(true_cfg_scale=4.0), "send negative_prompt with it"),
             ("sd", request(negative_prompt="blurry", true_cfg_scale=4.0), "send guidance_scale (> 1"),
             ("qwen-image", request(true_cfg_scale=4.0), "its guidance_scale is diffusers' true_cfg_scale")]
    for family, req, instead in cases:
        with pytest.raises(InvalidRequestError) as err:
            admitted(family, req)
        assert instead in str(err.value), err.value
