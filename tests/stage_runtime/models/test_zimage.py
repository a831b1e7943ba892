"""ZImagePipeline on the tiny Z-Image (single-stream DiT over [image ‖ caption] tokens, Qwen3 text encoder, flow
matching): request mode is one pipeline call, step mode one transformer forward per tick over every request's
rows given as lists (captions of their own lengths, padded in the model with a key mask), each equal to the bare
diffusers call with the same seed. Z-Image guides at any guidance_scale > 0 (pos + s·(pos − neg)), so guided,
weakly guided (s <= 1) and unguided (s = 0, Z-Image-Turbo's) requests share one forward; the pipeline's CFG
truncation and normalisation are mirrored (a subclass sets them: no request field does)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_probes import assert_no_state, max_diff, run_together, runner_of
from family_checks import Family, bare_pipeline, generators, make_engine, to_uint8

from stage_runtime.config import ModelConfig, load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.model_info import ModelInfo
from stage_runtime.models.registry import resolve_adapter_class
from stage_runtime.models.families.zimage import ZImageAdapter
from stage_runtime.request import DiffusionRequest, SamplingParams

torch.set_num_threads(1)
FAMILY = Family("zimage", guidances=(3.0, 0.0))          # the checklist (test_families.py)
TRUNCATED = "adapters_for_tests:TruncatedZImageAdapter"   # cfg_truncation 0.6, cfg_normalization 1.05
LONG = "a big red car parked on a long empty road by the sea at sunset"


def bare(path: str, prompt: str, steps: int, seed: int, guidance: float, n: int = 1, negative: str | None = None,
         size: tuple[int, int] = (64, 64), **knobs) -> np.ndarray:
    """ZImagePipeline's own __call__ (its negative prompt defaults to "")."""
    out = bare_pipeline(path)(prompt=[prompt] * n, negative_prompt=None if negative is None else [negative] * n,
                              guidance_scale=guidance, num_inference_steps=steps, height=size[0], width=size[1],
                              generator=generators(seed, n), output_type="np", **knobs).images
    return to_uint8(out)


def threadless(path: str, mode: str, adapter: str | None = None, cache: dict | None = None, **scheduler):
    """An engine without its loop thread: ``engine.step()`` is one tick (a wave in request mode)."""
    config = load_config({"model": {"path": path, "adapter": adapter}, "device": "cpu", "warmup": False,
                          "cache": cache or {}, "scheduler": {"execution_mode": mode, **scheduler}})
    return DiffusionEngine(config)


def req(rid: str, prompt: str, steps: int, seed: int, guidance: float, **kw) -> DiffusionRequest:
    return DiffusionRequest(rid, prompt, SamplingParams(num_inference_steps=steps, seed=seed, guidance_scale=guidance,
                                                        **{"height": 64, "width": 64, **kw}))


class Forwards:
    """The transformer's forwards and the rows of each (its first argument: the list of latents)."""

    def __init__(self, engine):
        self.rows: list[int] = []
        self.handle = runner_of(engine).adapter.denoiser.register_forward_pre_hook(
            lambda _m, args: self.rows.append(len(args[0])))

    def __enter__(self) -> "Forwards":
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


@pytest.fixture(scope="module")
def request_engine(tiny_zimage_path):
    engine = make_engine(tiny_zimage_path, max_num_seqs=4, request_batch_max_wait_ms=200, warmup=False)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def step_engine(tiny_zimage_path):
    engine = threadless(tiny_zimage_path, "step", max_num_seqs=4)
    yield engine
    engine.close()


def test_model_info(tiny_zimage_path):
    cls = resolve_adapter_class(ModelConfig(path=tiny_zimage_path))
    assert cls is ZImageAdapter
    info = cls.load(tiny_zimage_path, torch.device("cpu")).info()
    assert info == ModelInfo(
        pipeline_class="ZImagePipeline", adapter="stage_runtime.models.families.zimage:ZImageAdapter", default_height=64,
        default_width=64, default_steps=50, default_guidance=5.0, size_multiple=4, fixed_size=False,
        supports_request_batch=True, supports_step_execution=True, num_attention_heads=4, max_steps=1000,
        parallel_kinds=("cfg", "ring", "ulysses"), guidance="cfg", max_sequence_length=512,
        step_key=("height", "width"), refusals="stage_runtime.models.refusals:ZImageRefusals",
        lora_components=("transformer",))


def test_the_tiny_tokenizer_templates_the_prompt_as_qwen3_does(tiny_zimage_path):
    """The pipeline's chat template call (thinking on: no think block) and its empty-thinking variant."""
    tokenizer = bare_pipeline(tiny_zimage_path).tokenizer
    messages = [{"role": "user", "content": "a red car"}]
    on = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    off = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert on == "<|im_start|>user\na red car<|im_end|>\n<|im_start|>assistant\n"
    assert off == on + "<think>\n\n</think>\n\n"
    ids = tokenizer(on).input_ids
    assert tokenizer.convert_ids_to_tokens(ids[3:6]) == ["a", "Ġred", "Ġcar"] and tokenizer.unk_token_id not in ids


def test_request_mode_fuses_prompts_of_any_length_and_equals_the_bare_pipeline(request_engine, tiny_zimage_path):
    path = tiny_zimage_path
    with Forwards(request_engine) as forwards:
        a = request_engine.add_request(req("a", "a cat", 4, 1, 3.0))
        b = request_engine.add_request(req("b", LONG, 4, 2, 3.0, num_outputs=2, negative_prompt="a dog"))
        out_a, out_b = a.result(timeout=60).images, b.result(timeout=60).images
    assert forwards.rows == [6] * 4            # one forward a step: [pos of 3 images ‖ neg of 3]
    assert max_diff(out_a, bare(path, "a cat", 4, 1, 3.0)) <= 1
    assert max_diff(out_b, bare(path, LONG, 4, 2, 3.0, n=2, negative="a dog")) <= 1
    with Forwards(request_engine) as forwards:   # CFG at a scale <= 1 (diffusers: any s > 0), and none at 0
        weak = request_engine.add_request(req("weak", "a cat", 3, 5, 0.5, negative_prompt="blurry")).result(timeout=60)
        turbo = request_engine.add_request(req("turbo", "a cat", 3, 5, 0.0)).result(timeout=60)
    assert forwards.rows == [2] * 3 + [1] * 3
    assert max_diff(weak.images, bare(path, "a cat", 3, 5, 0.5, negative="blurry")) <= 1
    assert max_diff(turbo.images, bare(path, "a cat", 3, 5, 0.0)) <= 1
    assert max_diff(weak.images, turbo.images) > 5
    # 48x80: 12 x 20 = 240 image tokens, padded to 256 in the model
    wide = request_engine.add_request(req("wide", "a cat", 3, 6, 3.0, height=48, width=80)).result(timeout=60)
    assert max_diff(wide.images, bare(path, "a cat", 3, 6, 3.0, size=(48, 80))) <= 1
    assert_no_state(request_engine)


def test_step_mode_runs_guided_weak_and_unguided_requests_in_one_forward(step_engine, tiny_zimage_path):
    path = tiny_zimage_path
    batch = [req("guided", LONG, 6, 3, 3.0, negative_prompt="a dog"), req("turbo", "a cat", 3, 4, 0.0, num_outputs=2),
             req("weak", "a tree", 4, 5, 0.5)]
    with Forwards(step_engine) as forwards:
        out = run_together(step_engine, batch)
    assert forwards.rows == [6] * 3 + [4] + [2] * 2      # 2 + 2 + 2 rows, then turbo (3 steps), weak (4) are done
    assert max_diff(out["guided"].images, bare(path, LONG, 6, 3, 3.0, negative="a dog")) <= 2
    assert max_diff(out["turbo"].images, bare(path, "a cat", 3, 4, 0.0, n=2)) <= 2
    assert max_diff(out["weak"].images, bare(path, "a tree", 4, 5, 0.5)) <= 2
    assert_no_state(step_engine)


@pytest.mark.parametrize("mode", ["request", "step"])
def test_cfg_truncation_and_normalisation_mirror_the_pipeline(tiny_zimage_path, mode):
    """Past (1000 − t) / 1000 > 0.6 a step runs the positive rows alone, and the guided prediction's norm is capped:
    as ZImagePipeline does with cfg_truncation=0.6, cfg_normalization=1.05 (both change the image)."""
    path = tiny_zimage_path
    engine = threadless(path, mode, adapter=TRUNCATED, max_num_seqs=2)
    try:
        batch = [req("a", "a cat", 6, 1, 3.0), req("b", LONG, 6 if mode == "request" else 4, 2, 4.0 if mode == "step"
                                                else 3.0, negative_prompt="a dog")]
        with Forwards(engine) as forwards:
            out = run_together(engine, batch)
    finally:
        engine.close()
    knobs = {"cfg_truncation": 0.6, "cfg_normalization": 1.05}
    a, b = out["a"].images, out["b"].images
    assert max_diff(a, bare(path, "a cat", 6, 1, 3.0, **knobs)) <= (1 if mode == "request" else 2)
    steps_b, scale_b = (6, 3.0) if mode == "request" else (4, 4.0)
    assert max_diff(b, bare(path, LONG, steps_b, 2, scale_b, negative="a dog", **knobs)) <= (1 if mode == "request"
                                                                                            else 2)
    assert max_diff(a, bare(path, "a cat", 6, 1, 3.0, cfg_truncation=0.6)) > 0
    assert max_diff(a, bare(path, "a cat", 6, 1, 3.0, cfg_normalization=1.05)) > 0
    sigmas = torch.linspace(1.0, 1 / 6, 6)
    shifted = 3.0 * sigmas / (1 + 2.0 * sigmas)                # the scheduler's static shift 3
    truncated = int(((1000 - shifted * 1000) / 1000 > 0.6).sum())
    assert 0 < truncated < 6 and forwards.rows.count(2 if mode == "request" else 1) >= truncated
    assert sum(forwards.rows) < (24 if mode == "request" else 20)          # fewer rows than guided throughout


def test_block_cache_follows_the_image_tokens_while_batch_mates_come_and_go(tiny_zimage_path):
    """The unified sequence's length is the longest row's of the forward: a cached request keeps its signal and
    residual over its image tokens (adapter.cache_tokens), so batch-mates with longer captions joining and leaving
    neither break nor change it."""
    engine = threadless(tiny_zimage_path, "step", cache={"mode": "block", "threshold": 1.1, "warmup_steps": 2,
                                                         "final_steps": 1}, max_num_seqs=3)
    try:
        solo = run_together(engine, [req("cached", "a cat", 8, 1, 3.0)])["cached"]
        cached = engine.add_request(req("cached", "a cat", 8, 1, 3.0))
        with Forwards(engine) as forwards:
            for _ in range(3):
                assert engine.step()
            mate = engine.add_request(req("mate", LONG, 2, 2, 0.0))        # 38 caption tokens: 64, not 32
            while not (cached.finished and mate.finished):
                assert engine.step()
        together = cached.result(timeout=1)
        assert mate.result(timeout=1).ok
    finally:
        engine.close()
    assert forwards.rows == [2] * 3 + [3] * 2 + [2] * 3        # the mate's two steps in the cached request's forwards
    assert 0 < solo.metrics["steps_skipped"] == together.metrics["steps_skipped"] < 8
    assert max_diff(together.images, solo.images) <= 2
