"""Flux2KleinPipeline (FLUX.2 [klein]) on the tiny Klein: real CFG against the prompt "" in ONE transformer
forward per step (diffusers runs two), a request's ``negative_prompt`` as diffusers' ``negative_prompt_embeds``, a
step-distilled folder served unguided, its facts and refusals — and, its ``FAMILY`` row in the checklist
(test_families.py), equal to the bare diffusers call in request and step mode with a guided and an unguided request
sharing ticks, abort and progress."""

from __future__ import annotations

import pytest
import torch
from engine_probes import assert_no_state, count_denoiser_calls, max_diff
from family_checks import Family, bare_pipeline, generators, make_engine, req, to_uint8

from stage_runtime.config import ModelConfig, ParallelConfig
from stage_runtime.distributed.apply import apply_parallelism
from stage_runtime.errors import ConfigError, InvalidRequestError
from stage_runtime.model_info import ModelInfo
from stage_runtime.models.families.flux2_klein import Flux2KleinAdapter
from stage_runtime.models.registry import resolve_adapter_class
from stage_runtime.request import DiffusionRequest, SamplingParams

torch.set_num_threads(1)
SIZE = {"height": 64, "width": 64}
# The checklist: guidance 4 runs [negative; prompt] rows, guidance 1 the prompt rows only; both share ticks.
FAMILY = Family("flux2-klein", guidances=(4.0, 1.0))


def bare(path: str, prompt: str, steps: int, seed: int, guidance: float = 4.0, negative: str | None = None,
         n: int = 1):
    """diffusers' own call: the negative prompt only as embeddings of one image (its __call__ takes no
    negative_prompt, and repeats the embeddings for its images)."""
    pipe = bare_pipeline(path)
    negative_embeds = None if negative is None else pipe.encode_prompt(negative)[0]
    return to_uint8(pipe(prompt=prompt, negative_prompt_embeds=negative_embeds, guidance_scale=guidance,
                         num_inference_steps=steps, num_images_per_prompt=n, generator=generators(seed, n),
                         output_type="np", **SIZE).images)


@pytest.fixture(scope="module")
def engines(tiny_flux2_klein_path):
    made = {mode: make_engine(tiny_flux2_klein_path, mode, max_num_seqs=4, warmup=False)
            for mode in ("request", "step")}
    yield made
    for engine in made.values():
        engine.close()


@pytest.fixture(scope="module")
def distilled_path(tmp_path_factory) -> str:
    """The tiny Klein saved as a step-distilled folder (``is_distilled: true``)."""
    from stage_runtime.models.tiny.flux2_klein import build

    out = tmp_path_factory.mktemp("models") / "tiny-flux2-klein-distilled"
    build(0, is_distilled=True).save_pretrained(out)
    return str(out)


def load(path: str):
    cls = resolve_adapter_class(ModelConfig(path=path))
    assert cls is Flux2KleinAdapter
    return cls.load(path, torch.device("cpu"))


def test_model_info(tiny_flux2_klein_path):
    assert load(tiny_flux2_klein_path).info() == ModelInfo(
        pipeline_class="Flux2KleinPipeline", adapter="stage_runtime.models.families.flux2_klein:Flux2KleinAdapter",
        default_height=256, default_width=256, default_steps=50, default_guidance=4.0, size_multiple=4,
        fixed_size=False, supports_request_batch=True, supports_step_execution=True, num_attention_heads=4,
        max_steps=1000, parallel_kinds=("cfg", "ring", "ulysses"), guidance="cfg", max_sequence_length=512,
        refusals="stage_runtime.models.refusals:Flux2Refusals",
        request_key=("height", "width", "num_inference_steps", "guidance_scale", "edit_shapes"),
        step_key=("height", "width", "edit_shapes"), lora_components=("transformer",), edit_tasks=("instruct",),
        max_edit_images=10)


@pytest.mark.parametrize("mode, tolerance", [("request", 1), ("step", 2)])
def test_a_negative_prompt_is_diffusers_negative_prompt_embeds_in_one_forward_per_step(
        engines, tiny_flux2_klein_path, mode, tolerance):
    engine = engines[mode]
    calls = count_denoiser_calls(engine)
    out = engine.add_request(req("neg", "a red fox", 4, 7, negative_prompt="blurry", num_outputs=2,
                                 guidance_scale=5.0, **SIZE)).result(timeout=120)
    assert calls[0] == 4                            # diffusers makes 8: a prompt pass and a negative pass per step
    expected = bare(tiny_flux2_klein_path, "a red fox", 4, 7, guidance=5.0, negative="blurry", n=2)
    assert max_diff(out.images, expected) <= tolerance
    assert max_diff(out.images, bare(tiny_flux2_klein_path, "a red fox", 4, 7, guidance=5.0, n=2)) > 5  # it is used
    assert_no_state(engine)


def test_a_negative_prompt_without_guidance_is_refused(tiny_flux2_klein_path):
    adapter = load(tiny_flux2_klein_path)
    info = adapter.info()
    request = DiffusionRequest("n", "x", SamplingParams(negative_prompt="blurry", guidance_scale=1.0)).resolve(info)
    with pytest.raises(InvalidRequestError, match=r"^negative_prompt='blurry': unused at guidance_scale=1"):
        type(adapter).check_request(request, info)
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size=2 is not supported by Flux2KleinPipeline \(it "
                                          r"runs: cfg, ring, ulysses\): .*does not shard FLUX.2's attention"):
        apply_parallelism(adapter, None, ParallelConfig(tensor_parallel_size=2))


def test_a_step_distilled_folder_runs_unguided_and_refuses_guidance(distilled_path):
    adapter = load(distilled_path)
    info = adapter.info()
    assert (info.guidance, info.default_steps, info.default_guidance) == ("none", 4, 1.0)
    for field, sampling in (("guidance_scale", SamplingParams(guidance_scale=4.0)),
                            ("negative_prompt", SamplingParams(negative_prompt="blurry"))):
        with pytest.raises(InvalidRequestError) as refused:
            type(adapter).check_request(DiffusionRequest("r", "x", sampling).resolve(info), info)
        assert refused.value.field == field
    engine = make_engine(distilled_path, "step", max_num_seqs=2, warmup=False)
    try:
        calls = count_denoiser_calls(engine)
        out = engine.add_request(req("d", "a red fox", 3, 4, **SIZE)).result(timeout=120)
        assert calls[0] == 3                        # one row set: no negative pass
        # diffusers warns that the guidance scale is ignored and runs the prompt rows only, whatever the scale
        assert max_diff(out.images, bare(distilled_path, "a red fox", 3, 4, guidance=4.0)) <= 2
    finally:
        engine.close()
