"""Flux2Pipeline (FLUX.2 [dev]) on the tiny FLUX.2: its facts and keys, its refusals (a negative prompt: it is
guidance-distilled; an edit image; CFG parallel and tensor parallel at load, each with the reason), the schedule
per request (FLUX.2's ``mu`` depends on the step count), and — its ``FAMILY`` row in the checklist
(test_families.py) — equal to the bare diffusers call in request and step mode, two guidance scales (an embedding
per row) and two step counts sharing ticks, abort and progress."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from family_checks import Family

from stage_runtime.config import ModelConfig, ParallelConfig
from stage_runtime.distributed.apply import apply_parallelism
from stage_runtime.errors import ConfigError, InvalidRequestError
from stage_runtime.model_info import ModelInfo
from stage_runtime.models.families.flux2 import Flux2Adapter, flux2_scheduler
from stage_runtime.models.registry import resolve_adapter_class
from stage_runtime.request import DiffusionRequest, EditInput, SamplingParams

torch.set_num_threads(1)
# The checklist (test_families.py): guidance is an embedding per row, so two scales share ticks.
FAMILY = Family("flux2", guidances=(4.0, 2.5))


@pytest.fixture(scope="module")
def adapter(tiny_flux2_path):
    cls = resolve_adapter_class(ModelConfig(path=tiny_flux2_path))
    assert cls is Flux2Adapter
    return cls.load(tiny_flux2_path, torch.device("cpu"))


def test_model_info(adapter):
    assert adapter.info() == ModelInfo(
        pipeline_class="Flux2Pipeline", adapter="stage_runtime.models.families.flux2:Flux2Adapter",
        default_height=256, default_width=256, default_steps=50, default_guidance=4.0, size_multiple=4,
        fixed_size=False, supports_request_batch=True, supports_step_execution=True, num_attention_heads=4,
        max_steps=1000, parallel_kinds=("ring", "ulysses"), guidance="distilled", max_sequence_length=512,
        refusals="stage_runtime.models.refusals:Flux2Refusals",
        request_key=("height", "width", "num_inference_steps", "guidance_scale", "edit_shapes"),
        step_key=("height", "width", "edit_shapes"), lora_components=("transformer",), edit_tasks=("instruct",),
        max_edit_images=10)


@pytest.mark.parametrize("steps, side", [(3, 64), (6, 64), (4, 32)])
def test_each_request_gets_the_schedule_the_pipelines_call_sets(adapter, steps, side):
    """FLUX.2's shift ``mu`` depends on the image tokens AND the step count: a request's own scheduler has the
    timesteps (and sigmas) ``Flux2Pipeline.__call__`` sets for its size and steps."""
    tokens = (side // adapter.size_multiple()) ** 2
    seen = {}

    def capture(pipe, _i, _t, _kwargs):
        seen.setdefault("timesteps", pipe.scheduler.timesteps.clone())
        seen.setdefault("sigmas", pipe.scheduler.sigmas.clone())
        return {}

    bare = copy.copy(adapter.pipe)
    bare.scheduler = copy.deepcopy(adapter.pipe.scheduler)
    bare(prompt="x", height=side, width=side, num_inference_steps=steps, callback_on_step_end=capture,
         output_type="latent")
    own = flux2_scheduler(adapter.pipe.scheduler, steps, torch.device("cpu"), tokens)
    torch.testing.assert_close(own.timesteps, seen["timesteps"], rtol=0, atol=0)
    torch.testing.assert_close(own.sigmas, seen["sigmas"], rtol=0, atol=0)
    assert own.step_index is None and own.begin_index == 0


def test_cfg_and_tensor_parallel_are_refused_naming_family_degree_and_reason(adapter):
    with pytest.raises(ConfigError, match=r"^cfg_parallel_size=2 is not supported by Flux2Pipeline \(it runs: "
                                          r"ring, ulysses\): FLUX.2 \[dev\] is guidance-distilled"):
        apply_parallelism(adapter, None, ParallelConfig(cfg_parallel_size=2))
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size=2 is not supported by Flux2Pipeline .*does not "
                                          r"shard FLUX.2's attention"):
        apply_parallelism(adapter, None, ParallelConfig(tensor_parallel_size=2))


def test_ulysses_degree_that_does_not_divide_the_heads_is_refused(adapter):
    with pytest.raises(ConfigError, match=r"ulysses_degree=8 does not divide .*num_attention_heads=4"):
        apply_parallelism(adapter, None, ParallelConfig(ulysses_degree=8))


def test_negative_prompt_is_refused_and_a_guidance_scale_is_served(adapter):
    info = adapter.info()
    request = DiffusionRequest("n", "x", SamplingParams(negative_prompt="blurry")).resolve(info)
    with pytest.raises(InvalidRequestError, match="^negative_prompt='blurry': Flux2Pipeline is guidance-distilled"):
        type(adapter).check_request(request, info)          # what the engine calls at admission
    type(adapter).check_request(DiffusionRequest("g", "x", SamplingParams(guidance_scale=9.0)).resolve(info), info)


def test_a_masked_edit_and_one_reference_too_many_are_refused_naming_the_field(adapter):
    picture = np.zeros((64, 64, 3), dtype=np.uint8)
    with pytest.raises(InvalidRequestError) as refused:
        DiffusionRequest("e", "x", SamplingParams(height=64, width=64),
                         edit=EditInput(image=picture, mask=np.ones((64, 64), dtype=np.uint8))).resolve(adapter.info())
    assert "Flux2Pipeline does not serve inpaint edits (it serves: instruct)" in str(refused.value)
    with pytest.raises(InvalidRequestError) as refused:
        DiffusionRequest("e", "x", SamplingParams(height=64, width=64),
                         edit=EditInput(image=picture, more_images=(picture,) * 10)).resolve(adapter.info())
    assert refused.value.field == "image[10]" and "at most 10" in str(refused.value), str(refused.value)
    small = np.zeros((48, 64, 3), dtype=np.uint8)
    for pictures, field, words in (((picture, small), "image[1]", "at least 64 pixels a side"),
                                   ((np.zeros((64, 640, 3), dtype=np.uint8),), "image[0]", "at most 8:1")):
        request = DiffusionRequest("e", "x", SamplingParams(height=64, width=64), edit=EditInput(
            image=pictures[0], more_images=pictures[1:])).resolve(adapter.info())
        with pytest.raises(InvalidRequestError) as refused:
            type(adapter).check_request(request, adapter.info())         # what the engine calls at admission
        assert refused.value.field == field and words in str(refused.value), str(refused.value)


def test_sizes_off_the_packing_multiple_are_refused(adapter):
    with pytest.raises(InvalidRequestError) as refused:
        DiffusionRequest("s", "x", SamplingParams(height=66, width=64)).resolve(adapter.info())
    assert refused.value.field == "height"
