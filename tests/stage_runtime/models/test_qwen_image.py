"""QwenImagePipeline on the tiny Qwen-Image (dual-stream MMDiT, Qwen2.5-VL text encoder, flow matching with a
dynamic shift, true CFG): one fused transformer forward per step for prompt and negative rows, equal to the
bare diffusers call (which runs two) with the same seed, in request and step mode."""

from __future__ import annotations

import pytest
import torch
from engine_probes import assert_no_state, max_diff, runner_of
from family_checks import (Family, bare_pipeline, check_abort_at_random_steps, check_progress_in_order, generators,
                           make_engine, req, to_uint8)

from stage_runtime.config import ModelConfig
from stage_runtime.model_info import ModelInfo
from stage_runtime.models.flow_match import resolution_shift
from stage_runtime.models.families.qwen_image import QwenImageAdapter
from stage_runtime.models.registry import resolve_adapter_class

torch.set_num_threads(1)
SIZE = {"height": 64, "width": 64}
# The engines skip warmup: it runs at the model's default size, 512 px for the tiny Qwen-Image (~5 s here).
NO_WARMUP = {"warmup": False}


def bare(path: str, prompt: str, steps: int, seed: int, n: int = 1, negative: str = " ", guidance: float = 4.0,
         size: tuple[int, int] = (64, 64)):
    """diffusers' own __call__: true_cfg_scale = the request's guidance, a negative prompt enables it."""
    out = bare_pipeline(path)(prompt=prompt, negative_prompt=negative if guidance > 1 else None,
                              true_cfg_scale=guidance, num_inference_steps=steps, height=size[0], width=size[1],
                              num_images_per_prompt=n, generator=generators(seed, n), output_type="np").images
    return to_uint8(out)


def qwen_call(pipe, prompt: str, n: int, guidance: float) -> dict:
    """QwenImagePipeline's own keywords for the checklist: true CFG with the default negative prompt."""
    return {"prompt": prompt, "negative_prompt": " " if guidance > 1 else None, "true_cfg_scale": guidance,
            "num_images_per_prompt": n}


FAMILY = Family("qwen-image", call=qwen_call, guidances=(4.0, 4.0))   # the checklist (test_families.py)


@pytest.fixture(scope="module")
def request_engine(tiny_qwen_image_path):
    engine = make_engine(tiny_qwen_image_path, max_num_seqs=4, **NO_WARMUP)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def step_engine(tiny_qwen_image_path):
    engine = make_engine(tiny_qwen_image_path, mode="step", max_num_seqs=4, **NO_WARMUP)
    yield engine
    engine.close()


def test_model_info(tiny_qwen_image_path):
    cls = resolve_adapter_class(ModelConfig(path=tiny_qwen_image_path))
    assert cls is QwenImageAdapter
    info = cls.load(tiny_qwen_image_path, torch.device("cpu")).info()
    assert info == ModelInfo(
        pipeline_class="QwenImagePipeline", adapter="stage_runtime.models.families.qwen_image:QwenImageAdapter",
        default_height=512, default_width=512, default_steps=50, default_guidance=4.0, size_multiple=8,
        fixed_size=False, supports_request_batch=True, supports_step_execution=True, num_attention_heads=4,
        max_steps=1000, parallel_kinds=("cfg", "ring", "ulysses"), guidance="true_cfg", max_sequence_length=512,
        lora_components=("transformer",))


def test_dynamic_shift_is_linear_in_image_tokens():
    """Qwen-Image's shift is the shared flow-matching one (models.flow_match), read from its scheduler config."""
    config = {"base_image_seq_len": 256, "max_image_seq_len": 8192, "base_shift": 0.5, "max_shift": 0.9}
    assert resolution_shift(256, config, 1.15) == pytest.approx(0.5)
    assert resolution_shift(8192, config, 1.15) == pytest.approx(0.9)
    assert resolution_shift(4224, config, 1.15) == pytest.approx(0.7)


def test_request_mode_equals_the_bare_pipeline(request_engine, tiny_qwen_image_path):
    path = tiny_qwen_image_path
    calls = [0]
    handle = runner_of(request_engine).adapter.denoiser.register_forward_pre_hook(
        lambda _m, _a: calls.__setitem__(0, calls[0] + 1))
    try:
        alone = request_engine.add_request(req("alone", "a red fox", 4, 11, num_outputs=2, **SIZE)).result(timeout=60)
    finally:
        handle.remove()
    assert calls[0] == 4                         # one forward per step for prompt and negative rows
    assert max_diff(alone.images, bare(path, "a red fox", 4, 11, n=2)) <= 1
    # fused: prompts of different lengths (padded, masked), a negative prompt, one request at its own seed
    a = request_engine.add_request(req("a", "a cat", 4, 1, **SIZE))
    b = request_engine.add_request(req("b", "a big blue car on the road", 4, 2, negative_prompt="a dog", **SIZE))
    assert max_diff(a.result(timeout=60).images, bare(path, "a cat", 4, 1)) <= 1
    assert max_diff(b.result(timeout=60).images, bare(path, "a big blue car on the road", 4, 2, negative="a dog")) <= 1
    plain = request_engine.add_request(req("g1", "a cat", 3, 5, guidance_scale=1.0, **SIZE)).result(timeout=60)
    assert max_diff(plain.images, bare(path, "a cat", 3, 5, guidance=1.0)) <= 1
    wide = request_engine.add_request(req("wide", "a cat", 3, 6, height=48, width=80)).result(timeout=60)
    assert max_diff(wide.images, bare(path, "a cat", 3, 6, size=(48, 80))) <= 1
    assert_no_state(request_engine)


def test_request_mode_progress_and_abort(request_engine):
    check_progress_in_order(request_engine, "a cat", **SIZE)
    check_abort_at_random_steps(request_engine, "a cat", **SIZE)


def test_step_mode_equals_the_bare_pipeline(step_engine, tiny_qwen_image_path):
    alone = step_engine.add_request(req("alone", "a red fox", 4, 11, num_outputs=2, **SIZE)).result(timeout=60)
    assert max_diff(alone.images, bare(tiny_qwen_image_path, "a red fox", 4, 11, n=2)) <= 2
    assert_no_state(step_engine)
