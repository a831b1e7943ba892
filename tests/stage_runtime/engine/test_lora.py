"""LoRA adapters through the real engine (in-process executor) on the tiny SD (UNet + CLIP text encoder) and
FLUX (transformer + CLIP) pipelines — and for the equality, leak and mixed-batch tests SD3, SDXL (UNet + both
CLIP encoders) and Qwen-Image (transformer) — against diffusers' own load_lora_weights + set_adapters."""

from __future__ import annotations

import numpy as np
import pytest
from engine_probes import assert_no_state, count_denoiser_calls, max_diff, runner_of
from lora_probes import bare_with_loras, write_adapter

from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.errors import InvalidRequestError, LoraConflictError, LoraLoadError, LoraNotFoundError
from stage_runtime.request import DiffusionRequest, SamplingParams

FAMILIES = {"sd": 7.5, "flux": 3.5}        # kind → guidance (SD: CFG rows; FLUX: distilled, no CFG rows)
# Qwen-Image's: true CFG (prompt, negative); FLUX.2 [dev]: an embedding; Klein and Z-Image: CFG rows
GUIDANCE = {**FAMILIES, "sd3": 7.0, "sdxl": 5.0, "qwen-image": 4.0, "flux2": 4.0, "flux2-klein": 4.0, "zimage": 5.0}
PROMPT, STEPS, SEED = "a photo of a cat", 3, 11


def _family(kind, paths, tmp_path_factory):
    path = paths[kind]
    out = tmp_path_factory.mktemp(f"lora-{kind}")
    gain = 0.3 if kind in ("sd", "sdxl") else 1.0
    adapters = {name: write_adapter(path, out / name, seed=seed, gain=gain) for name, seed in (("a", 1), ("b", 2))}
    return kind, path, adapters


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tiny_sd_path, tiny_flux_path, tmp_path_factory):
    """SD (UNet + CLIP) and FLUX (transformer + CLIP): every test."""
    return _family(request.param, {"sd": tiny_sd_path, "flux": tiny_flux_path}, tmp_path_factory)


@pytest.fixture(scope="module", params=list(GUIDANCE))
def any_family(request, tiny_model, tmp_path_factory):
    """Plus SD3 (transformer + two CLIP encoders, CFG rows), SDXL (UNet + two CLIP encoders, CFG rows) and
    Qwen-Image (transformer; [prompt; negative] true-CFG rows), FLUX.2 [dev] and [klein] and Z-Image (transformer;
    Klein and Z-Image with CFG rows) for the equality, leak and mixed-batch tests."""
    return _family(request.param, {request.param: tiny_model(request.param)}, tmp_path_factory)


def bare_kw(kind: str, guidance: float) -> dict:
    """The bare call's guidance keywords: Qwen-Image's guidance_scale is diffusers' true_cfg_scale (negative " ")."""
    if kind == "qwen-image":
        return {"true_cfg_scale": guidance, "negative_prompt": " "}
    return {"guidance_scale": guidance}


def make_engine(path: str, adapters: dict[str, str], mode: str, wait_ms: float = 0, **extra) -> DiffusionEngine:
    config = load_config({"model": {"path": path}, "device": "cpu", "warmup": False,
                          "loras": [{"name": n, "path": p} for n, p in adapters.items()],
                          "scheduler": {"execution_mode": mode, "max_num_seqs": 4,
                                        "request_batch_max_wait_ms": wait_ms}, **extra})
    return DiffusionEngine.make_engine(config)


def req(rid: str, guidance: float, loras=(), seed: int = SEED, **kw) -> DiffusionRequest:
    return DiffusionRequest(rid, PROMPT, SamplingParams(**{"num_inference_steps": STEPS, "seed": seed, "height": 64,
                                                           "width": 64, "guidance_scale": guidance, "loras": loras,
                                                           **kw}))


def run(engine, rid, guidance, loras=(), **kw) -> np.ndarray:
    return engine.add_request(req(rid, guidance, loras, **kw)).result(timeout=120).images


@pytest.mark.parametrize("mode", ["request", "step"])
def test_adapters_equal_diffusers_set_adapters_and_scale_zero_is_the_base(any_family, mode):
    kind, path, adapters = any_family
    g = GUIDANCE[kind]
    eng = make_engine(path, adapters, mode)
    try:
        base = run(eng, "base", g)
        one = run(eng, "a", g, [{"name": "a", "scale": 1.0}])
        zero = run(eng, "a0", g, [{"name": "a", "scale": 0.0}])
        two = run(eng, "ab", g, [{"name": "a", "scale": 0.7}, {"name": "b", "scale": -0.4}])
        tolerance = 1 if mode == "request" else 2
        assert max_diff(one, bare_with_loras(path, {"a": adapters["a"]}, [1.0], PROMPT, STEPS, SEED,
                                             **bare_kw(kind, g))) <= tolerance
        assert max_diff(two, bare_with_loras(path, adapters, [0.7, -0.4], PROMPT, STEPS, SEED,
                                             **bare_kw(kind, g))) <= tolerance
        assert max_diff(base, bare_with_loras(path, {}, None, PROMPT, STEPS, SEED, **bare_kw(kind, g))) <= tolerance
        assert max_diff(zero, base) <= 1
        assert max_diff(one, base) >= 3 and max_diff(two, one) >= 3, "the adapters changed nothing"
        assert_no_state(eng)
    finally:
        eng.close()


def test_a_base_request_after_ten_lora_requests_is_bitwise_the_base(any_family):
    kind, path, adapters = any_family
    g = GUIDANCE[kind]
    eng = make_engine(path, adapters, "step")
    try:
        before = run(eng, "before", g)
        streams = [eng.add_request(req(f"l{i}", g, [{"name": "ab"[i % 2], "scale": 0.5 + i / 10}], seed=i))
                   for i in range(10)]
        for s in streams:
            s.result(timeout=120)
        after = run(eng, "after", g)
        assert np.array_equal(before, after)
    finally:
        eng.close()


SETS = {"base": (), "a": ({"name": "a", "scale": 0.8},), "b": ({"name": "b", "scale": 1.2},),
        "ab": ({"name": "a", "scale": 0.5}, {"name": "b", "scale": 0.5})}


@pytest.mark.parametrize("mode", ["step", "request"])
def test_mixed_adapters_share_one_denoiser_forward_per_step_and_equal_their_solo_runs(any_family, mode):
    """Step mode: one tick; request mode: one fused pipeline call (the family batches) — either way ONE
    denoiser forward per denoising step for base, a, b and a+b together."""
    kind, path, adapters = any_family
    g, sets = GUIDANCE[kind], SETS
    eng = make_engine(path, adapters, mode, wait_ms=300 if mode == "request" else 0)
    try:
        solo = {name: run(eng, f"solo-{name}", g, loras, seed=i) for i, (name, loras) in enumerate(sets.items())}
        calls = count_denoiser_calls(eng)
        hooks_before = runner_of(eng).adapter.loras.forward_calls()
        streams = {}
        with eng._lock:                  # admitted together: the first tick holds all four
            for i, (name, loras) in enumerate(sets.items()):
                streams[name] = eng.add_request(req(f"mix-{name}", g, loras, seed=i))
        outs = {name: s.result(timeout=120).images for name, s in streams.items()}
        assert calls[0] == STEPS, f"{calls[0]} denoiser forwards for 4 requests of {STEPS} steps: not shared"
        assert runner_of(eng).adapter.loras.forward_calls() > hooks_before
        for name in sets:
            assert max_diff(outs[name], solo[name]) <= (2 if mode == "step" else 1), name
        assert max_diff(outs["a"], outs["base"]) > 0
    finally:
        eng.close()


def test_unknown_adapter_is_refused_before_admission_and_unload_in_use_is_a_conflict(family):
    kind, path, adapters = family
    g = FAMILIES[kind]
    eng = make_engine(path, {"a": adapters["a"]}, "step")
    try:
        with pytest.raises(InvalidRequestError) as exc:
            eng.add_request(req("u", g, [{"name": "a"}, {"name": "nope"}]))
        assert exc.value.field == "loras.1.name" and "nope" in str(exc.value)
        assert eng.num_request_states() == 0
        with eng._lock:                  # queued, not yet run: in use all the same
            stream = eng.add_request(req("user", g, [{"name": "a"}]))
            with pytest.raises(LoraConflictError, match="'a' is in use by 1 in-flight request"):
                eng.collective_rpc("unload_lora", ("a",))
        stream.result(timeout=120)
        assert eng.collective_rpc("unload_lora", ("a",)) == {"name": "a", "unloaded": True}
        with pytest.raises(LoraNotFoundError):
            eng.collective_rpc("unload_lora", ("a",))
        with pytest.raises(InvalidRequestError, match="loras.0.name"):
            eng.add_request(req("gone", g, [{"name": "a"}]))
    finally:
        eng.close()


def test_max_loras_evicts_the_least_recently_used_unpinned_adapter(family, tmp_path):
    kind, path, adapters = family
    g = FAMILIES[kind]
    eng = make_engine(path, {"a": adapters["a"]}, "step", max_loras=2)      # a: a startup adapter, pinned
    try:
        eng.collective_rpc("load_lora", ("b", adapters["b"]))
        c = write_adapter(path, tmp_path / "c", seed=3)
        assert eng.collective_rpc("load_lora", ("c", c))["evicted"] == "b"   # never the pinned one
        assert [e["name"] for e in eng.collective_rpc("list_loras")] == ["a", "c"]
        run(eng, "uses-c", g, [{"name": "c"}])
        eng.collective_rpc("unload_lora", ("c",))
        eng.collective_rpc("load_lora", ("b", adapters["b"], True))
        with pytest.raises(LoraConflictError, match="max_loras=2"):
            eng.collective_rpc("load_lora", ("c", c))
        with pytest.raises(LoraConflictError, match="already loaded"):
            eng.collective_rpc("load_lora", ("b", adapters["b"]))
        assert list(runner_of(eng).adapter.loras.adapters) == ["a", "b"]
    finally:
        eng.close()


def test_an_adapter_for_another_architecture_is_refused_at_run_time_naming_it_and_the_key(family):
    kind, path, adapters = family
    other = dict(family_adapters_of_other_kind(family))
    eng = make_engine(path, {}, "step")
    try:
        with pytest.raises(LoraLoadError, match=r"LoRA adapter 'x' from '.*other-(sd|flux)\.safetensors' matches no "
                                                r"module of the served model: key '(unet|transformer)\."):
            eng.collective_rpc("load_lora", ("x", other["path"]))
        assert eng.collective_rpc("list_loras") == []
        assert runner_of(eng).adapter.loras.adapters == {}
    finally:
        eng.close()


def family_adapters_of_other_kind(family):
    """A file written for the other family: SD's has unet.* keys, FLUX's transformer.* keys."""
    kind, _, adapters = family
    import safetensors.torch as st
    from pathlib import Path

    src = Path(adapters["a"]) / "pytorch_lora_weights.safetensors"
    tensors = st.load_file(str(src))
    wrong = "transformer" if kind == "sd" else "unet"
    own = "unet" if kind == "sd" else "transformer"
    renamed = {(wrong + k[len(own):] if k.startswith(own + ".") else k): v for k, v in tensors.items()}
    out = src.parent.parent / f"other-{kind}.safetensors"
    st.save_file(renamed, str(out))
    return {"path": str(out)}


IMG2IMG = {"sd": ("StableDiffusionImg2ImgPipeline", 7.5, {}),            # kind → class, guidance, from_pipe keywords
           "sdxl": ("StableDiffusionXLImg2ImgPipeline", 5.0, {"requires_aesthetics_score": False}),
           "flux": ("FluxImg2ImgPipeline", 3.5, {})}


@pytest.mark.parametrize("mode", ["request", "step"])
@pytest.mark.parametrize("kind", list(IMG2IMG))
def test_an_img2img_edit_with_an_adapter_equals_diffusers_img2img_with_it(kind, mode, tiny_model, tmp_path_factory):
    import diffusers
    import torch
    from lora_probes import load_pipe
    from PIL import Image

    from stage_runtime.request import EditInput

    (cls, g, from_pipe_kw), model = IMG2IMG[kind], tiny_model(kind)
    path = write_adapter(model, tmp_path_factory.mktemp(f"edit-lora-{kind}") / "a", seed=1,
                         gain=1.0 if kind == "flux" else 0.3)
    y, x = np.mgrid[0:64, 0:64] / 64
    image = ((np.stack([np.sin(6 * x), np.cos(5 * y), x * y], -1) + 1) * 127).clip(0, 255).astype(np.uint8)
    eng = make_engine(model, {"a": path}, mode)
    try:
        out = eng.add_request(DiffusionRequest("edit", PROMPT, SamplingParams(
            num_inference_steps=6, seed=SEED, guidance_scale=g, height=64, width=64,
            loras=[{"name": "a", "scale": 0.9}]), edit=EditInput(image, None, 0.6))).result(timeout=120).images
    finally:
        eng.close()
    pipe = load_pipe(model)
    pipe.load_lora_weights(path, adapter_name="a")
    pipe.set_adapters(["a"], [0.9])
    size = {"height": 64, "width": 64} if kind == "flux" else {}         # (SD's take the image's)
    ref = getattr(diffusers, cls).from_pipe(pipe, **from_pipe_kw)(
        prompt=PROMPT, image=Image.fromarray(image, "RGB"), strength=0.6, num_inference_steps=6, guidance_scale=g,
        generator=torch.Generator("cpu").manual_seed(SEED), output_type="np", **size).images
    assert max_diff(out, (ref * 255).round().clip(0, 255).astype(np.uint8)) <= (1 if mode == "request" else 2)


def test_two_ulysses_ranks_in_worker_processes_load_check_and_apply_the_same_adapters(tiny_sd_path, tmp_path_factory):
    """The multiprocess executor: startup and run-time loads reach every rank, a refusal comes back from the
    ranks as a LoraLoadError (400), and per-row LoRA holds under the sequence split (rows stay whole)."""
    out = tmp_path_factory.mktemp("mp-lora")
    a, b = (write_adapter(tiny_sd_path, out / n, seed=s) for n, s in (("a", 1), ("b", 2)))
    eng = make_engine(tiny_sd_path, {"a": a}, "step", executor="mp", parallel={"ulysses_degree": 2})
    try:
        eng.collective_rpc("load_lora", ("b", b))
        held = eng.rank_rpc("list_loras")
        assert [[s["name"] for s in rank] for rank in held] == [["a", "b"], ["a", "b"]]
        with pytest.raises(LoraLoadError, match="LoRA adapter 'x' from .* matches no module"):
            eng.collective_rpc("load_lora", ("x", family_adapters_of_other_kind(("sd", None, {"a": a}))["path"]))
        assert [[s["name"] for s in rank] for rank in eng.rank_rpc("list_loras")] == [["a", "b"], ["a", "b"]]
        image = run(eng, "ab", 7.5, [{"name": "a", "scale": 0.7}, {"name": "b", "scale": -0.4}])
    finally:
        eng.close()
    ref = bare_with_loras(tiny_sd_path, {"a": a, "b": b}, [0.7, -0.4], PROMPT, STEPS, SEED, guidance_scale=7.5)
    assert max_diff(image, ref) <= 2


@pytest.mark.parametrize("kind", ["flux", "qwen-image"])
def test_lora_rows_follow_the_block_cache_when_some_rows_skip_the_later_blocks(kind, tiny_model, tmp_path_factory):
    """FLUX and Qwen-Image (its prompt and negative rows) with the block cache: a request that skips blocks
    1..N-1 (a huge threshold) next to one that always computes (cache off): the later blocks run on the computing
    rows only and their LoRA plan follows them."""
    out, path, g = tmp_path_factory.mktemp(f"lora-block-cache-{kind}"), tiny_model(kind), GUIDANCE[kind]
    a, b = (write_adapter(path, out / n, seed=s, gain=1.0) for n, s in (("a", 1), ("b", 2)))
    eng = make_engine(path, {"a": a, "b": b}, "step", cache={"mode": "block", "threshold": 10.0})
    sets = {"skips": ([{"name": "a"}], None), "computes": ([{"name": "b", "scale": 0.7}], "off")}
    try:
        solo = {k: run(eng, f"solo-{k}", g, loras, seed=i, cache=c, num_inference_steps=5)
                for i, (k, (loras, c)) in enumerate(sets.items())}
        calls = count_denoiser_calls(eng)
        with eng._lock:
            streams = {k: eng.add_request(req(f"mix-{k}", g, loras, seed=i, cache=c, num_inference_steps=5))
                       for i, (k, (loras, c)) in enumerate(sets.items())}
        results = {k: s.result(timeout=120) for k, s in streams.items()}
    finally:
        eng.close()
    assert calls[0] == 5, f"{calls[0]} denoiser forwards for two 5-step requests: a fused tick failed and was split"
    assert results["skips"].metrics["steps_skipped"] > 0 and "steps_skipped" not in results["computes"].metrics
    for k in sets:
        assert max_diff(results[k].images, solo[k]) <= 2, k


@pytest.mark.parametrize("mode", ["request", "step"])
def test_a_kontext_instruction_edit_with_an_adapter_equals_diffusers_with_it(mode, tiny_flux_kontext_path,
                                                                            tmp_path_factory):
    import torch
    from lora_probes import load_pipe
    from PIL import Image

    from stage_runtime.request import EditInput

    path = write_adapter(tiny_flux_kontext_path, tmp_path_factory.mktemp("kontext-lora") / "a", seed=1, gain=1.0)
    y, x = np.mgrid[0:64, 0:64] / 64
    image = ((np.stack([np.sin(6 * x), np.cos(5 * y), x * y], -1) + 1) * 127).clip(0, 255).astype(np.uint8)
    eng = make_engine(tiny_flux_kontext_path, {"a": path}, mode)
    try:
        out = eng.add_request(DiffusionRequest("edit", PROMPT, SamplingParams(
            num_inference_steps=4, seed=SEED, guidance_scale=3.5, height=64, width=64,
            loras=[{"name": "a", "scale": 0.9}]), edit=EditInput(image))).result(timeout=120).images
    finally:
        eng.close()
    pipe = load_pipe(tiny_flux_kontext_path)
    pipe.load_lora_weights(path, adapter_name="a")
    pipe.set_adapters(["a"], [0.9])
    ref = pipe(prompt=PROMPT, image=Image.fromarray(image, "RGB"), num_inference_steps=4, guidance_scale=3.5,
               height=64, width=64, max_area=64 * 64, _auto_resize=False,
               generator=[torch.Generator("cpu").manual_seed(SEED)], output_type="np").images
    assert max_diff(out, (ref * 255).round().clip(0, 255).astype(np.uint8)) <= (1 if mode == "request" else 2)
