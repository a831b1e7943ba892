"""A compiled tiny SD (UNet: its BasicTransformerBlock, diffusers' ``_repeated_blocks``) in a worker process, step
mode, two compile shapes: a load that mixes both sizes, CFG on and off, LoRA rows and plain rows in one tick, with an
adapter loaded and unloaded after warm-up, compiles no graph after warm-up; LoRA ticks run eagerly and say so; every
image is within 2 (uint8) of the same engine without compile; a second engine on the same cache folder compiles warm
(every graph a cache hit); a request checkpointed mid-way resumes from the file to its image."""

from __future__ import annotations

import dataclasses

import pytest
from engine_probes import max_diff
from lora_probes import write_adapter

from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.request import DiffusionRequest, SamplingParams

SHAPES = ("64x64", "32x32")
# (request id, side, guidance, LoRA scale or None): both sizes, CFG on and off, adapted and plain rows
LOAD = [("a64", 64, 7.5, 0.8), ("p64", 64, 7.5, None), ("b64", 64, 7.5, 1.2), ("u64", 64, 1.0, None),
        ("a32", 32, 7.5, 0.8), ("p32", 32, 7.5, None), ("u32", 32, 1.0, 0.5)]


def make_engine(path: str, compile_mode: str, cache_dir: str) -> DiffusionEngine:
    config = {"model": {"path": path}, "device": "cpu", "executor": "mp",
              "scheduler": {"execution_mode": "step", "max_num_seqs": 4}}
    if compile_mode != "none":
        config["compile"] = {"mode": compile_mode, "cache_dir": cache_dir, "shapes": list(SHAPES)}
    return DiffusionEngine.make_engine(load_config(config))


def checkpointed(engine: DiffusionEngine, folder) -> tuple:
    """A long request checkpointed between two ticks, run on to its end; then a request resuming from the file: (the
    step it was saved at, the uninterrupted image, the resumed image)."""
    def long(rid: str) -> DiffusionRequest:
        return DiffusionRequest(rid, "a red car", SamplingParams(num_inference_steps=120, seed=5, height=64, width=64,
                                                                 stream=True))

    stream = engine.add_request(long("whole"))
    assert not stream.get(timeout=300).finished           # a progress event: it has taken a step
    path = str(folder / "whole.safetensors")
    [saved] = engine.collective_rpc("checkpoint_request", ("whole", path))
    whole = stream.result(timeout=300).images
    resumed = engine.add_request(dataclasses.replace(long("resumed"), resume_from=path)).result(timeout=300).images
    return saved["step"], whole, resumed


def run_load(engine: DiffusionEngine, adapter: str) -> dict:
    engine.collective_rpc("load_lora", ("ink", adapter))
    streams = {rid: engine.add_request(DiffusionRequest(rid, "a cat", SamplingParams(
        num_inference_steps=4, seed=7, height=side, width=side, guidance_scale=g,
        loras=() if scale is None else ({"name": "ink", "scale": scale},)))) for rid, side, g, scale in LOAD}
    images = {rid: s.result(timeout=300).images for rid, s in streams.items()}
    engine.collective_rpc("unload_lora", ("ink",))
    images["after"] = engine.add_request(DiffusionRequest("after", "a dog", SamplingParams(
        num_inference_steps=3, seed=1, height=64, width=64))).result(timeout=300).images
    assert engine.num_request_states() == 0 and engine.collective_rpc("num_request_states") == [0]
    return images


@pytest.fixture(scope="module")
def runs(tiny_sd_path, tmp_path_factory):
    """The compiled engine on an empty cache folder (cold), the same again (warm), the eager engine."""
    cache = str(tmp_path_factory.mktemp("compile-cache"))
    adapter = str(write_adapter(tiny_sd_path, tmp_path_factory.mktemp("lora") / "ink", seed=3, gain=0.3))
    out = {}
    for name, mode in (("cold", "regional"), ("warm", "regional"), ("eager", "none")):
        engine = make_engine(tiny_sd_path, mode, cache)
        try:
            warmed = engine.compile_warmup_stats
            images = run_load(engine, adapter) if name != "warm" else {}
            if name == "cold":
                images["checkpoint"] = checkpointed(engine, tmp_path_factory.mktemp("checkpoint"))
            out[name] = (warmed, engine.collective_rpc("compile_stats") if mode != "none" else None, images)
        finally:
            engine.close()
    return out


def test_loading_adapters_and_mixing_their_rows_compiles_nothing_after_warm_up(runs):
    (warmed,), (after,), _ = runs["cold"]
    assert warmed["mode_effective"] == "regional" and warmed["warm"] and warmed["graphs"] >= 2, warmed
    assert warmed["regions"] == [{"name": "BasicTransformerBlock", "modules": 4}], warmed
    assert (after["graphs"], after["recompiles"]) == (warmed["graphs"], 0), after
    assert after["eager_calls"].get("lora", 0) >= 4, "the ticks with adapted rows ran compiled"


def test_a_compiled_request_checkpointed_mid_way_resumes_to_its_image(runs):
    step, whole, resumed = runs["cold"][2]["checkpoint"]
    assert 0 <= step < 120
    assert max_diff(resumed, whole) <= 2
    assert runs["cold"][1][0]["recompiles"] == 0


def test_compiled_images_are_within_2_of_eager(runs):
    compiled, eager = runs["cold"][2], runs["eager"][2]
    compiled = {rid: images for rid, images in compiled.items() if rid != "checkpoint"}
    assert set(compiled) == set(eager) == {rid for rid, *_ in LOAD} | {"after"}
    for rid in compiled:
        assert max_diff(compiled[rid], eager[rid]) <= 2, rid
    assert max_diff(compiled["a64"], compiled["p64"]) >= 3, "the adapter changed nothing"


def test_a_restarted_engine_compiles_from_the_cache(runs):
    (cold,), _, _ = runs["cold"]
    (warm,), _, _ = runs["warm"]
    assert cold["cache"] == "miss" and warm["cache"] == "hit", (cold, warm)
    assert warm["graphs"] == cold["graphs"] and warm["mode_effective"] == "regional"
