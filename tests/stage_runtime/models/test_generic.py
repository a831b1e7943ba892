"""The generic adapter: a diffusers pipeline class with no dedicated adapter (StableDiffusionPAGPipeline and
StableDiffusionSAGPipeline built from the tiny SD components) serves in request mode, equal to the bare call,
and says at startup what it cannot do."""

from __future__ import annotations

import logging

import pytest
import torch
from engine_probes import assert_no_state, max_diff
from family_checks import (bare_pipeline, check_abort_at_random_steps, check_progress_in_order, generators,
                           make_engine, req, to_uint8)

from stage_runtime.config import ModelConfig, ParallelConfig
from stage_runtime.distributed.apply import apply_parallelism
from stage_runtime.errors import ConfigError, InvalidRequestError, ModelLoadError
from stage_runtime.models.families.generic import GenericDiffusersAdapter
from stage_runtime.models.registry import resolve_adapter_class
from stage_runtime.request import DiffusionRequest, SamplingParams

torch.set_num_threads(1)


def bare(path: str, prompts: list[str], steps: int, seed: int):
    """The pipeline's own __call__: one generator per image (seed + i), as the engine seeds them."""
    pipe = bare_pipeline(path)
    out = pipe(prompt=prompts, negative_prompt=[""] * len(prompts), num_inference_steps=steps, guidance_scale=7.5,
               height=64, width=64, generator=generators(seed, len(prompts)), output_type="np").images
    return to_uint8(out)


@pytest.fixture(scope="module")
def pag_engine(tiny_pag_path):
    engine = make_engine(tiny_pag_path, max_num_seqs=2)
    yield engine
    engine.close()


def test_a_class_without_a_dedicated_adapter_gets_the_generic_one(tiny_pag_path, tiny_sag_path):
    for path in (tiny_pag_path, tiny_sag_path):
        assert resolve_adapter_class(ModelConfig(path=path)) is GenericDiffusersAdapter


def test_request_mode_equals_the_bare_pipeline_alone_and_fused(pag_engine, tiny_pag_path):
    alone = pag_engine.add_request(req("alone", "a red fox", 4, 11, num_outputs=2)).result(timeout=60)
    assert max_diff(alone.images, bare(tiny_pag_path, ["a red fox"] * 2, 4, 11)) <= 1
    a = pag_engine.add_request(req("a", "a cat", 4, 1))
    b = pag_engine.add_request(req("b", "a blue car", 4, 2))
    assert max_diff(a.result(timeout=60).images, bare(tiny_pag_path, ["a cat"], 4, 1)) <= 1
    assert max_diff(b.result(timeout=60).images, bare(tiny_pag_path, ["a blue car"], 4, 2)) <= 1
    assert_no_state(pag_engine)


def test_progress_arrives_in_order_through_callback_on_step_end(pag_engine):
    check_progress_in_order(pag_engine, "a cat", steps=5)


def test_abort_at_a_random_step_releases_everything(pag_engine):
    check_abort_at_random_steps(pag_engine, "a cat")


def test_startup_says_what_the_generic_adapter_cannot_do(tiny_pag_path, tiny_sag_path, caplog):
    with caplog.at_level(logging.WARNING, logger="stage_runtime.models.families.generic"):
        pag = GenericDiffusersAdapter.load(tiny_pag_path, torch.device("cpu"))
        sag = GenericDiffusersAdapter.load(tiny_sag_path, torch.device("cpu"))
    said = caplog.text
    assert ("StableDiffusionPAGPipeline is served by the generic diffusers adapter: request mode only (no step "
            "mode, no CFG-parallel, no Ulysses); progress and abort at every step through callback_on_step_end") in said
    assert ("StableDiffusionSAGPipeline is served by the generic diffusers adapter" in said
            and "no callback_on_step_end: no progress events, abort only before the pipeline call starts" in said)
    info = pag.info()
    assert (info.pipeline_class, info.supports_step_execution, info.supports_request_batch, info.parallel_kinds,
            info.default_steps, info.default_guidance) == ("StableDiffusionPAGPipeline", False, True, (), 50, 7.5)
    assert sag.has_step_callback is False and pag.has_step_callback is True


def test_a_pipeline_without_callback_on_step_end_still_serves_without_progress(tiny_sag_path):
    engine = make_engine(tiny_sag_path)
    try:
        items = list(engine.add_request(req("sag", "a cat", 3, 4, stream=True)))
        # no step progress (the call takes no callback), only its phases: encode, decode, then the result
        assert [(i.phase, i.finished) for i in items] == [("encode", False), ("decode", False), (None, True)]
        pipe = bare_pipeline(tiny_sag_path)
        ref = pipe(prompt=["a cat"], negative_prompt=[""], num_inference_steps=3, guidance_scale=7.5,
                   generator=generators(4, 1), output_type="np").images
        assert max_diff(items[-1].images, to_uint8(ref)) <= 1
        assert_no_state(engine)
    finally:
        engine.close()


def test_step_mode_is_refused_at_startup_naming_the_pipeline(tiny_pag_path):
    with pytest.raises(ConfigError, match="pipeline StableDiffusionPAGPipeline .* does not implement step execution"):
        make_engine(tiny_pag_path, mode="step")


@pytest.mark.parametrize(("field", "degree"), [("cfg_parallel_size", 2), ("ulysses_degree", 2)])
def test_parallel_kinds_are_refused_naming_the_pipeline_and_degree(tiny_pag_path, field, degree):
    adapter = GenericDiffusersAdapter.load(tiny_pag_path, torch.device("cpu"))
    with pytest.raises(ConfigError) as exc:
        apply_parallelism(adapter, None, ParallelConfig(**{field: degree}))
    assert f"{field}={degree} is not supported by StableDiffusionPAGPipeline" in str(exc.value)
    assert "generic diffusers adapter" in str(exc.value)


def test_the_call_parameters_reach_model_info_and_what_the_call_lacks_is_refused(tiny_pag_path, tiny_dit_path):
    pag = GenericDiffusersAdapter.load(tiny_pag_path, torch.device("cpu")).info()
    assert pag.call_params == ("prompt", "negative_prompt", "height", "width", "num_inference_steps",
                               "guidance_scale", "num_images_per_prompt") and not pag.fixed_size
    # DiTPipeline.__call__(class_labels, guidance_scale, generator, num_inference_steps, ...): no prompt lists,
    # no negative prompt, no size, no num_images_per_prompt
    bare = GenericDiffusersAdapter.load(tiny_dit_path, torch.device("cpu")).info()
    assert bare.call_params == ("num_inference_steps", "guidance_scale") and bare.fixed_size
    assert not bare.supports_request_batch
    for info, sampling, field in ((bare, {"negative_prompt": "blurry"}, "negative_prompt"),
                                  (bare, {"num_outputs": 2}, "num_outputs"),
                                  (bare, {"height": 32}, "height")):
        with pytest.raises(InvalidRequestError) as err:
            GenericDiffusersAdapter.check_request(DiffusionRequest("r", "x", SamplingParams(**sampling)).resolve(info),
                                                  info)
        assert err.value.field == field
    for sampling in ({"negative_prompt": "blurry", "num_outputs": 2}, {"height": 32, "width": 32}):
        GenericDiffusersAdapter.check_request(DiffusionRequest("r", "x", SamplingParams(**sampling)).resolve(pag), pag)


def test_a_class_diffusers_does_not_know_is_a_model_load_error(tmp_path):
    (tmp_path / "model_index.json").write_text('{"_class_name": "NoSuchPipeline"}')
    with pytest.raises(ModelLoadError, match="'NoSuchPipeline' is neither served by a dedicated adapter"):
        GenericDiffusersAdapter.load(str(tmp_path), torch.device("cpu"))


def _prompt_only(prompt: str, generator: torch.Generator | None = None): ...
def _lists(prompt: str | list[str], generator: "torch.Generator | list[torch.Generator] | None" = None): ...
def _typing_lists(prompt: "Union[str, List[str]]", generator=None): ...  # noqa: F821 - an unevaluated annotation


@pytest.mark.parametrize(("fn", "prompt", "generator"), [(_prompt_only, False, False), (_lists, True, True),
                                                          (_typing_lists, True, False)])
def test_fused_batches_need_list_prompts_and_generators(fn, prompt, generator):
    import inspect

    from stage_runtime.models.families.generic import _accepts_list

    params = inspect.signature(fn).parameters
    assert (_accepts_list(params["prompt"]), _accepts_list(params["generator"])) == (prompt, generator)
    assert _accepts_list(None) is False


def test_without_callback_on_step_end_a_running_call_finishes_then_ends_aborted(tiny_sag_path):
    """No step boundary inside the call: an abort while it runs is applied when it returns (never a hang),
    and every trace of the request is gone."""
    from engine_probes import runner_of, wait_until

    from stage_runtime.errors import RequestAbortedError
    from stage_runtime.request import RequestStatus

    engine = make_engine(tiny_sag_path, warmup=False)
    clock = [0]
    runner_of(engine).adapter.denoiser.register_forward_pre_hook(lambda _m, _a: clock.__setitem__(0, clock[0] + 1))
    try:
        stream = engine.add_request(req("long", "a cat", 20, 1))

        def running() -> bool:
            state = engine.scheduler.get_request_state("long")
            return state is not None and state.status == RequestStatus.RUNNING

        wait_until(running, timeout=30)
        assert engine.abort("long") == ["long"]
        with pytest.raises(RequestAbortedError):
            stream.result(timeout=120)
        assert clock[0] == 1                 # the one boundary before the call; none inside it
        assert_no_state(engine)
    finally:
        engine.close()
