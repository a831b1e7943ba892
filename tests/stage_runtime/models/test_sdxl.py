"""StableDiffusionXLPipeline on the tiny SDXL (two CLIP encoders, pooled embeddings, micro-conditioning, Euler):
request and step mode equal the bare diffusers call with the same seed (negative prompts, no guidance, other
sizes: the time ids follow); progress and abort in request mode (step mode's: the checklist, test_families.py)."""

from __future__ import annotations

import pytest
import torch
from engine_probes import assert_no_state, max_diff
from family_checks import (Family, bare_pipeline, check_abort_at_random_steps, check_progress_in_order, generators,
                           make_engine, req, to_uint8)

from stage_runtime.config import ModelConfig
from stage_runtime.model_info import ModelInfo
from stage_runtime.models.registry import resolve_adapter_class
from stage_runtime.models.families.sdxl import StableDiffusionXLAdapter

torch.set_num_threads(1)
FAMILY = Family("sdxl", guidances=(5.0, 5.0))      # the checklist (test_families.py): step mode, abort, progress


def bare(path: str, prompt: str, steps: int, seed: int, n: int = 1, negative: str | None = None,
         guidance: float = 5.0, size: tuple[int, int] = (64, 64)):
    kw = {} if negative is None else {"negative_prompt": [negative] * n}
    out = bare_pipeline(path)(prompt=[prompt] * n, num_inference_steps=steps, guidance_scale=guidance,
                              height=size[0], width=size[1], generator=generators(seed, n), output_type="np",
                              **kw).images
    return to_uint8(out)


@pytest.fixture(scope="module")
def request_engine(tiny_sdxl_path):
    engine = make_engine(tiny_sdxl_path, max_num_seqs=4)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def step_engine(tiny_sdxl_path):
    engine = make_engine(tiny_sdxl_path, mode="step", max_num_seqs=4)
    yield engine
    engine.close()


def test_model_info(tiny_sdxl_path):
    cls = resolve_adapter_class(ModelConfig(path=tiny_sdxl_path))
    assert cls is StableDiffusionXLAdapter
    info = cls.load(tiny_sdxl_path, torch.device("cpu")).info()
    assert info == ModelInfo(
        pipeline_class="StableDiffusionXLPipeline", adapter="stage_runtime.models.families.sdxl:StableDiffusionXLAdapter",
        default_height=64, default_width=64, default_steps=30, default_guidance=5.0, size_multiple=8,
        fixed_size=False, supports_request_batch=True, supports_step_execution=True, num_attention_heads=4,
        max_steps=999, parallel_kinds=("cfg", "ulysses"), guidance="cfg", max_sequence_length=77,
        edit_tasks=("img2img", "inpaint"), lora_components=("unet", "text_encoder", "text_encoder_2"))


def test_request_mode_equals_the_bare_pipeline(request_engine, tiny_sdxl_path):
    alone = request_engine.add_request(req("alone", "a red fox", 4, 11, num_outputs=2)).result(timeout=60)
    assert max_diff(alone.images, bare(tiny_sdxl_path, "a red fox", 4, 11, n=2)) <= 1
    # fused with a request that has a negative prompt and one without guidance: each equals its solo call
    a = request_engine.add_request(req("a", "a cat", 4, 1))
    b = request_engine.add_request(req("b", "a blue car", 4, 2, negative_prompt="a dog"))
    assert max_diff(a.result(timeout=60).images, bare(tiny_sdxl_path, "a cat", 4, 1)) <= 1
    assert max_diff(b.result(timeout=60).images, bare(tiny_sdxl_path, "a blue car", 4, 2, negative="a dog")) <= 1
    plain = request_engine.add_request(req("g1", "a cat", 3, 5, guidance_scale=1.0)).result(timeout=60)
    assert max_diff(plain.images, bare(tiny_sdxl_path, "a cat", 3, 5, guidance=1.0)) <= 1
    other = request_engine.add_request(req("wide", "a cat", 3, 6, height=48, width=80)).result(timeout=60)
    assert max_diff(other.images, bare(tiny_sdxl_path, "a cat", 3, 6, size=(48, 80))) <= 1   # time ids follow size
    assert_no_state(request_engine)


def test_request_mode_progress_and_abort(request_engine):
    check_progress_in_order(request_engine, "a cat")
    check_abort_at_random_steps(request_engine, "a cat")


def test_step_mode_equals_the_bare_pipeline(step_engine, tiny_sdxl_path):
    alone = step_engine.add_request(req("alone", "a red fox", 4, 11, num_outputs=2)).result(timeout=60)
    assert max_diff(alone.images, bare(tiny_sdxl_path, "a red fox", 4, 11, n=2)) <= 2
    neg = step_engine.add_request(req("neg", "a red fox", 4, 12, negative_prompt="a dog")).result(timeout=60)
    assert max_diff(neg.images, bare(tiny_sdxl_path, "a red fox", 4, 12, negative="a dog")) <= 2
    assert_no_state(step_engine)
