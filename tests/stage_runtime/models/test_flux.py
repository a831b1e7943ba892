"""FluxPipeline (FLUX.1): its facts, its keys, a negative prompt without true CFG refused saying what to send,
Kontext's CFG parallel refused with the reason. (True CFG itself: test_flux_true_cfg.py; CFG parallel on 2 ranks:
distributed/test_flux_cfg_parallel.py; equal to the bare call, step batching of different step counts and guidance
scales, abort and progress: its ``FAMILY`` row in the checklist, test_families.py.)"""

from __future__ import annotations

import pytest
import torch
from family_checks import Family

from stage_runtime.config import ModelConfig, ParallelConfig
from stage_runtime.distributed.apply import apply_parallelism
from stage_runtime.errors import ConfigError, InvalidRequestError
from stage_runtime.models.registry import resolve_adapter_class
from stage_runtime.request import DiffusionRequest, SamplingParams

torch.set_num_threads(1)
# The checklist (test_families.py): guidance is an embedding per row, so two scales share ticks.
FAMILY = Family("flux", guidances=(3.5, 6.0))


@pytest.fixture(scope="module")
def adapter(tiny_flux_path):
    return resolve_adapter_class(ModelConfig(path=tiny_flux_path)).load(tiny_flux_path, torch.device("cpu"))


def test_facts(adapter):
    info = adapter.info()
    assert (info.pipeline_class, info.adapter) == ("FluxPipeline", "stage_runtime.models.families.flux:FluxAdapter")
    assert info.guidance == "distilled" and info.parallel_kinds == ("cfg", "ring", "tp", "ulysses") and info.true_cfg
    assert info.edit_tasks == ("img2img", "inpaint") and info.edit_step_rule == "flow"
    assert (info.default_steps, info.default_guidance, info.default_height, info.size_multiple) == (28, 3.5, 64, 4)
    assert info.max_sequence_length == 512 and info.num_attention_heads == 2
    assert info.supports_step_execution and info.supports_request_batch
    assert info.lora_components == ("transformer", "text_encoder")     # CLIP only: T5 is not adapted
    # a pipeline call takes one true CFG scale; in step mode true-CFG rows are per request
    assert info.request_key == ("height", "width", "num_inference_steps", "guidance_scale", "true_cfg_scale")
    assert info.step_key == ("height", "width")        # timesteps, guidance and true CFG are per row


def test_step_key_ignores_steps_and_guidance_request_key_does_not(adapter):
    info = adapter.info()
    a = DiffusionRequest("a", "x", SamplingParams(num_inference_steps=3, guidance_scale=2.0)).resolve(info)
    b = DiffusionRequest("b", "x", SamplingParams(num_inference_steps=7, guidance_scale=5.0)).resolve(info)
    c = DiffusionRequest("c", "x", SamplingParams(height=32, width=32)).resolve(info)
    d = DiffusionRequest("d", "x", SamplingParams(num_inference_steps=3, guidance_scale=2.0, negative_prompt="y",
                                                  true_cfg_scale=4.0)).resolve(info)
    assert a.step_key == b.step_key == d.step_key != c.step_key
    assert a.batch_key != b.batch_key and a.batch_key != d.batch_key


def test_kontext_still_refuses_cfg_parallel_with_the_reason(tiny_flux_kontext_path):
    kontext = resolve_adapter_class(ModelConfig(path=tiny_flux_kontext_path)).load(tiny_flux_kontext_path,
                                                                                     torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"^cfg_parallel_size=2 is not supported by FluxKontextPipeline "
                                          r"\(it runs: no in-model parallelism\): .*conditioning tokens"):
        apply_parallelism(kontext, None, ParallelConfig(cfg_parallel_size=2))


def test_ulysses_degree_that_does_not_divide_the_heads_is_refused(adapter):
    with pytest.raises(ConfigError, match=r"ulysses_degree=4 does not divide .*num_attention_heads=2"):
        apply_parallelism(adapter, None, ParallelConfig(ulysses_degree=4))


def test_negative_prompt_is_refused_from_the_facts_the_loaded_adapter_reports(adapter):
    info = adapter.info()
    request = DiffusionRequest("n", "x", SamplingParams(negative_prompt="blurry")).resolve(info)
    with pytest.raises(InvalidRequestError, match="^negative_prompt='blurry': FluxPipeline is guidance-distilled"
                                                  r".*send true_cfg_scale > 1 with it"):
        type(adapter).check_request(request, info)          # what the engine calls at admission
    true_cfg = SamplingParams(negative_prompt="blurry", true_cfg_scale=4.0)
    type(adapter).check_request(DiffusionRequest("t", "x", true_cfg).resolve(info), info)
    type(adapter).check_request(DiffusionRequest("g", "x", SamplingParams(guidance_scale=9.0)).resolve(info), info)
