"""LoRA adapters on the Wan family through the real engine (models/families/wan.py, models/lora): adapters on the transformer's
attention and feed-forward linears (what step-distillation LoRAs adapt), served unfused per row, against diffusers'
own ``load_lora_weights`` + ``set_adapters`` on every frame.

Wan 2.2 A14B has two experts. As diffusers' WanLoraLoaderMixin: an adapter's ``transformer.`` keys adapt
``transformer`` (``load_lora_weights``), its ``transformer_2.`` keys the low-noise expert
(``load_lora_weights(..., load_into_transformer_2=True)``); one served adapter may carry both, one request's scale
then scales both (``set_adapters([high, low], [s, s])``). Each expert's call gets the LoRA rows of the rows routed
to it, so a tick with one request on each expert (one with the adapter, one without) equals each solo run, with the
block cache too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image
from engine_probes import max_diff, run_together, runner_of
from family_checks import Family, reference_image
from lora_probes import bare_with_loras, original_layout_file, two_expert_file, write_adapter

from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.errors import LoraLoadError

torch.set_num_threads(1)
ROWS = {"wan": Family("wan", size=16, frames=9), "wan22": Family("wan22", size=16, frames=9),
        "wan-ti2v": Family("wan-ti2v", size=32, frames=9), "wan-i2v": Family("wan-i2v", size=16, frames=9,
                                                                            reference=True)}
ADAPTER = {"wan": "wan", "wan22": "both", "wan-ti2v": "ti2v", "wan-i2v": "i2v"}   # the adapter each kind's tests serve
PROMPT, STEPS, SEED, SCALE, GUIDANCE = "a red fox running", 3, 11, 0.8, 5.0
_ENGINES: dict[tuple, DiffusionEngine] = {}


@pytest.fixture(scope="module")
def files(tiny_wan_path, tiny_wan22_path, tiny_wan_ti2v_path, tiny_wan_i2v_path, tmp_path_factory) -> dict[str, str]:
    """Random rank-4 adapters written by peft + diffusers' save_lora_weights: Wan 2.1's; Wan 2.2's pair as diffusers
    saves them (high- and low-noise expert, both ``transformer.…``) and the one file of both that the stage serves."""
    out = tmp_path_factory.mktemp("wan-loras")        # (the tiny Wan 2.2 needs a larger gain to show each expert's)
    made = {"wan": write_adapter(tiny_wan_path, out / "wan", seed=1, text_encoder=False, gain=1.0),
            "i2v": write_adapter(tiny_wan_i2v_path, out / "i2v", seed=4, text_encoder=False, gain=1.0),
            "ti2v": write_adapter(tiny_wan_ti2v_path, out / "ti2v", seed=5, text_encoder=False, gain=1.0),
            "high": write_adapter(tiny_wan22_path, out / "high", seed=2, text_encoder=False, gain=3.0),
            "low": write_adapter(tiny_wan22_path, out / "low", seed=3, text_encoder=False, gain=3.0,
                                 expert="transformer_2")}
    made["both"] = two_expert_file(made["high"], made["low"], out / "both")
    return made


def engine_for(tiny_model, files, kind: str, mode: str) -> DiffusionEngine:
    if (kind, mode) not in _ENGINES:
        loras = {"wan22": ("both", "high")}.get(kind, (ADAPTER[kind],))
        config = load_config({"model": {"path": tiny_model(kind)}, "device": "cpu", "warmup": False,
                              "loras": [{"name": name, "path": files[name]} for name in loras],
                              "scheduler": {"execution_mode": mode, "max_num_seqs": 2}})
        _ENGINES[(kind, mode)] = DiffusionEngine(config)          # threadless: step() runs it
    return _ENGINES[(kind, mode)]


@pytest.fixture(scope="module", autouse=True)
def _close_engines():
    yield
    for engine in _ENGINES.values():
        engine.close()
    _ENGINES.clear()


def request(kind: str, rid: str, lora: str | None = None, steps: int = STEPS, seed: int = SEED, **kw):
    loras = [{"name": lora, "scale": SCALE}] if lora else []
    return ROWS[kind].request(rid, PROMPT, steps, seed, guidance_scale=GUIDANCE, loras=loras, **kw)


def bare(kind: str, path: str, adapters: dict[str, str], **kw):
    size = ROWS[kind].size
    if ROWS[kind].reference:                   # diffusers gives a T2V adapter zero factors on the image projections
        kw["image"] = Image.fromarray(reference_image(size), mode="RGB")
    return bare_with_loras(path, adapters, [SCALE] * len(adapters), PROMPT, STEPS, SEED, size=size, num_frames=9,
                           guidance_scale=GUIDANCE, **kw)


@pytest.mark.parametrize("mode", ["request", "step"])
@pytest.mark.parametrize("kind", list(ROWS))
def test_an_adapter_equals_diffusers_load_lora_weights_on_every_frame(tiny_model, files, kind, mode):
    engine = engine_for(tiny_model, files, kind, mode)
    slots = runner_of(engine).adapter.loras.slots
    before = {part: slot.calls for part, slot in slots.items()}
    ours = run_together(engine, [request(kind, "r", ADAPTER[kind])])["r"].images
    if kind != "wan22":
        reference = bare(kind, tiny_model(kind), {ADAPTER[kind]: files[ADAPTER[kind]]})
        others = [bare(kind, tiny_model(kind), {})]                      # the adapter changes the video
    else:                                      # both experts: the pair loaded as diffusers' Wan 2.2 docs load it
        reference = bare(kind, tiny_model(kind), {"high": files["high"], "low": files["low"]},
                         into_transformer_2=("low",))
        others = [bare(kind, tiny_model(kind), {"high": files["high"]}),   # and each expert's part does
                  bare(kind, tiny_model(kind), {"low": files["low"]}, into_transformer_2=("low",))]
        assert slots["transformer_2"].calls > before["transformer_2"]
    assert slots["transformer"].calls > before["transformer"]
    assert ours.shape == (1, 9, ROWS[kind].size, ROWS[kind].size, 3)
    assert max_diff(ours, reference) <= (1 if mode == "request" else 2)
    assert all(max_diff(ours, other) > 5 for other in others)


def test_on_wan22_transformer_keys_adapt_only_the_high_noise_expert(tiny_model, files):
    """A file saved by diffusers (``transformer.`` keys) is what ``load_lora_weights`` puts on ``transformer``."""
    engine = engine_for(tiny_model, files, "wan22", "step")
    slots = runner_of(engine).adapter.loras.slots
    low_before = slots["transformer_2"].calls
    ours = run_together(engine, [request("wan22", "h", "high")])["h"].images
    assert slots["transformer_2"].calls == low_before
    assert max_diff(ours, bare("wan22", tiny_model("wan22"), {"high": files["high"]})) <= 2


@pytest.mark.parametrize("mode", ["request", "step"])
@pytest.mark.parametrize("kind", ["wan", "wan22"])
def test_a_batch_of_a_row_with_the_adapter_and_one_without_equals_each_solo_run(tiny_model, files, kind, mode):
    """Step mode on Wan 2.2: 6 steps (2 on transformer) next to 2 (1): the second tick runs one on each expert."""
    engine = engine_for(tiny_model, files, kind, mode)
    lora = ADAPTER[kind]
    steps = (STEPS, STEPS) if mode == "request" else (6, 2)
    batch = [request(kind, "adapted", lora, steps=steps[0], seed=1), request(kind, "plain", steps=steps[1], seed=2)]
    calls = [0]
    handle = runner_of(engine).adapter.denoiser.register_forward_pre_hook(
        lambda _m, _a: calls.__setitem__(0, calls[0] + 1))
    try:
        together = run_together(engine, batch)
    finally:
        handle.remove()
    assert calls[0] == max(steps)                                   # one forward per step for both
    for r in batch:
        solo = run_together(engine, [r])[r.request_id].images
        assert max_diff(together[r.request_id].images, solo) <= (1 if mode == "request" else 2), r.request_id
    base = run_together(engine, [request(kind, "base", steps=steps[0], seed=1)])["base"].images
    assert max_diff(together["adapted"].images, base) > 10


def test_wan22_with_the_block_cache_the_adapter_rows_follow_the_computing_rows(tiny_model, files):
    """A plain request under a huge threshold skips its later blocks while the adapted one computes them: the
    expert's LoRA plan follows the computing rows (models.lora's subset), and each equals its solo run."""
    engine = engine_for(tiny_model, files, "wan22", "step")
    batch = [request("wan22", "adapted", "both", steps=6, seed=1),
             request("wan22", "cached", steps=6, seed=2, cache={"threshold": 10.0})]
    calls = [0]
    handle = runner_of(engine).adapter.denoiser.register_forward_pre_hook(
        lambda _m, _a: calls.__setitem__(0, calls[0] + 1))
    try:
        together = run_together(engine, batch)
    finally:
        handle.remove()
    assert calls[0] == 6                                  # one forward per tick for both (no solo retry after an error)
    assert together["cached"].metrics["steps_skipped"] == 3         # steps 1, 3, 4 (step 2 is transformer_2's first)
    for r in batch:
        solo = run_together(engine, [r])[r.request_id].images
        assert max_diff(together[r.request_id].images, solo) <= 2, r.request_id


def test_a_transformer_2_key_on_wan21_is_refused_naming_it(tiny_model, files):
    engine = engine_for(tiny_model, files, "wan", "step")
    with pytest.raises(LoraLoadError, match=r"'both' from '.*/both/pytorch_lora_weights\.safetensors' matches no "
                                            r"module of the served model: key "
                                            r"'transformer_2\.blocks\..*' targets 'transformer_2', this model's LoRA "
                                            r"components are transformer$"):
        engine.collective_rpc("load_lora", ("both", files["both"]))
    assert [a["name"] for a in engine.collective_rpc("list_loras")] == ["wan"]


def test_a_published_layout_is_served_as_diffusers_converts_it(tiny_model, files, tmp_path):
    """A lightx2v-style file as its authors publish it: the stage reads it through WanPipeline.lora_state_dict (keys
    renamed, alpha folded into the factors), so it equals load_lora_weights of the same file; a plain request after
    it is the base model, bitwise."""
    engine, path = engine_for(tiny_model, files, "wan", "step"), tiny_model("wan")
    original = original_layout_file(path, tmp_path / "published", seed=7)
    before = run_together(engine, [request("wan", "b0")])["b0"].images
    engine.collective_rpc("load_lora", ("published", str(original)))
    try:
        ours = run_together(engine, [request("wan", "c", "published")])["c"].images
        after = run_together(engine, [request("wan", "b1")])["b1"].images
    finally:
        engine.collective_rpc("unload_lora", ("published",))
    assert max_diff(ours, bare("wan", path, {"published": str(original)})) <= 2
    assert max_diff(ours, bare("wan", path, {})) > 5
    assert (before == after).all()


def test_a_step_distill_file_with_bias_differences_is_served_per_row_beside_a_plain_request(tiny_model, files,
                                                                                           tmp_path):
    """CausVid / lightx2v as downloaded: ``diff_b`` bias differences (diffusers: ``lora_B.bias``) and zeroed norm
    ``diff`` keys (diffusers drops them). In one step batch beside a request without it, each equals diffusers
    loading the same file, and the bias does change the video."""
    engine, path = engine_for(tiny_model, files, "wan", "step"), tiny_model("wan")
    distill = original_layout_file(path, tmp_path / "distill", seed=8, biases=True)
    plain = original_layout_file(path, tmp_path / "nobias", seed=8)
    engine.collective_rpc("load_lora", ("distill", str(distill)))
    try:
        listed = {a["name"]: a for a in engine.collective_rpc("list_loras")}
        together = run_together(engine, [request("wan", "plain"), request("wan", "distilled", "distill")])
    finally:
        engine.collective_rpc("unload_lora", ("distill",))
    assert listed["distill"]["modules"] == {"transformer": 16}
    assert max_diff(together["distilled"].images, bare("wan", path, {"distill": str(distill)})) <= 2
    assert max_diff(together["plain"].images, bare("wan", path, {})) <= 2
    assert max_diff(bare("wan", path, {"distill": str(distill)}), bare("wan", path, {"nobias": str(plain)})) > 2, \
        "the biases change the video"


def test_wan22s_published_pair_folder_is_one_adapter_of_both_experts(tiny_model, files, tmp_path):
    """Wan 2.2 LoRAs are published as a folder of two files (lightx2v: ``high_noise_model.safetensors``,
    ``low_noise_model.safetensors``): served as one adapter, the high-noise file on ``transformer`` and the low-noise
    one on ``transformer_2``, equal to diffusers' ``load_lora_weights(high)`` + ``load_lora_weights(low,
    load_into_transformer_2=True)``, beside a plain request in one tick; on a one-expert model the folder is refused."""
    engine, path = engine_for(tiny_model, files, "wan22", "step"), tiny_model("wan22")
    pair = tmp_path / "Wan2.2-T2V-A14B-4steps-lora"
    high = original_layout_file(path, pair, seed=9, biases=True, name="high_noise_model.safetensors")
    low = original_layout_file(path, pair, seed=10, biases=True, name="low_noise_model.safetensors")
    engine.collective_rpc("load_lora", ("lightning", str(pair)))
    try:
        listed = {a["name"]: a for a in engine.collective_rpc("list_loras")}
        together = run_together(engine, [request("wan22", "plain"), request("wan22", "fast", "lightning")])
    finally:
        engine.collective_rpc("unload_lora", ("lightning",))
    assert listed["lightning"]["modules"] == {"transformer": 16, "transformer_2": 16}
    reference = bare("wan22", path, {"high": str(high), "low": str(low)}, into_transformer_2=("low",))
    assert max_diff(together["fast"].images, reference) <= 2
    assert max_diff(together["plain"].images, bare("wan22", path, {})) <= 2
    one_expert = engine_for(tiny_model, files, "wan", "step")
    with pytest.raises(LoraLoadError, match=r"holds a Wan 2\.2 pair .* for two experts, and this model has one"):
        one_expert.collective_rpc("load_lora", ("lightning", str(pair)))
