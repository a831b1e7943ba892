"""LoRA files in the layouts people have them — PEFT, diffusers' training-script layout, kohya / sd-scripts — built
locally from seeded random adapters (lora_layouts) for SD, SDXL and FLUX, served by name through the real engine
(models.lora reads each through the family pipeline's own diffusers loader):

- each equals diffusers' own ``load_lora_weights(file)`` + ``set_adapters`` of the same file (request mode within
  1 uint8, step mode within 2), and each changes the image;
- module by module, the factors and scaling the stage holds are the PEFT layers diffusers injects;
- a plain request after them is the base model, bitwise;
- a file made for another architecture is refused naming the file and a key (400 at run time)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_probes import assert_no_state, max_diff, runner_of
from lora_layouts import LAYOUTS, write_layout
from lora_probes import bare_with_loras, load_pipe
from safetensors import safe_open

from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.errors import LoraLoadError
from stage_runtime.request import DiffusionRequest, SamplingParams

torch.set_num_threads(1)
GUIDANCE = {"sd": 7.5, "sdxl": 5.0, "flux": 3.5}
GAIN = {"sd": 0.3, "sdxl": 0.3, "flux": 1.0}           # the tiny FLUX needs a larger one to show the adapter
PROMPT, STEPS, SEED, SCALE = "a photo of a cat", 3, 11, 0.8
_BARE: dict[tuple[str, str | None], np.ndarray] = {}


@pytest.fixture(scope="module")
def files(tiny_model, tmp_path_factory) -> dict[tuple[str, str], str]:
    """(kind, layout) → the file (or folder) of one random adapter per kind, seed 1, in each layout."""
    out = tmp_path_factory.mktemp("lora-layouts")
    return {(kind, layout): write_layout(layout, tiny_model(kind), out / f"{kind}-{layout}", seed=1,
                                         gain=GAIN[kind])
            for kind in GUIDANCE for layout in LAYOUTS}


def bare(tiny_model, files, kind: str, layout: str | None) -> np.ndarray:
    """diffusers' own call with ``pipe.load_lora_weights(file)`` + ``set_adapters([layout], [SCALE])`` (None: base)."""
    if (kind, layout) not in _BARE:
        adapters = {} if layout is None else {layout: files[(kind, layout)]}
        _BARE[(kind, layout)] = bare_with_loras(tiny_model(kind), adapters, [SCALE] if adapters else None, PROMPT,
                                                STEPS, SEED, guidance_scale=GUIDANCE[kind])
    return _BARE[(kind, layout)]


def make_engine(path: str, adapters: dict[str, str], mode: str) -> DiffusionEngine:
    config = load_config({"model": {"path": path}, "device": "cpu", "warmup": False,
                          "loras": [{"name": n, "path": p} for n, p in adapters.items()],
                          "scheduler": {"execution_mode": mode, "max_num_seqs": 4}})
    return DiffusionEngine.make_engine(config)


def run(engine: DiffusionEngine, rid: str, kind: str, loras=()) -> np.ndarray:
    sampling = SamplingParams(num_inference_steps=STEPS, seed=SEED, height=64, width=64,
                              guidance_scale=GUIDANCE[kind], loras=list(loras))
    return engine.add_request(DiffusionRequest(rid, PROMPT, sampling)).result(timeout=120).images


@pytest.mark.parametrize("mode", ["request", "step"])
@pytest.mark.parametrize("kind", list(GUIDANCE))
def test_each_layout_served_by_name_equals_diffusers_load_lora_weights_then_a_plain_request_is_the_base(
        tiny_model, files, kind, mode):
    engine = make_engine(tiny_model(kind), {layout: files[(kind, layout)] for layout in LAYOUTS}, mode)
    try:
        base = run(engine, "base", kind)
        served = {layout: run(engine, layout, kind, [{"name": layout, "scale": SCALE}]) for layout in LAYOUTS}
        after = run(engine, "after", kind)
        assert_no_state(engine)
    finally:
        engine.close()
    tolerance = 1 if mode == "request" else 2
    assert max_diff(base, bare(tiny_model, files, kind, None)) <= tolerance
    for layout, image in served.items():
        assert max_diff(image, bare(tiny_model, files, kind, layout)) <= tolerance, layout
        assert max_diff(image, base) >= 3, f"the {layout} adapter changed nothing"
    assert np.array_equal(after, base)
    if kind != "flux":       # SD, SDXL: the kohya file holds the PEFT file's adapter (other alphas on the convs)
        assert max_diff(served["kohya"], served["peft"]) <= tolerance


@pytest.mark.parametrize("kind", list(GUIDANCE))
def test_the_factors_held_are_the_peft_layers_diffusers_injects_module_by_module(tiny_model, files, kind):
    """What ``load_lora_weights`` puts on each module (scaling · B A of its PEFT layer) is what the stage holds,
    for every layout: the same modules, the same delta bit for bit (kohya's alphas, SDXL's SGM names, FLUX's fused
    qkv and diffusers' old keys included)."""
    from peft.tuners.lora import LoraLayer

    engine = make_engine(tiny_model(kind), {layout: files[(kind, layout)] for layout in LAYOUTS}, "step")
    try:
        held = runner_of(engine).adapter.loras.adapters
    finally:
        engine.close()
    for layout in LAYOUTS:
        pipe = load_pipe(tiny_model(kind))
        pipe.load_lora_weights(files[(kind, layout)], adapter_name="x")
        injected = {(c, name): layer for c in ("unet", "transformer", "text_encoder", "text_encoder_2")
                    if getattr(pipe, c, None) is not None for name, layer in getattr(pipe, c).named_modules()
                    if isinstance(layer, LoraLayer) and "x" in layer.lora_A}
        ours = {(c, path): f for c, modules in held[layout].modules.items() for path, f in modules.items()}
        assert ours.keys() == injected.keys(), layout
        for key, layer in injected.items():
            a, b = layer.lora_A["x"].weight, layer.lora_B["x"].weight
            theirs = (b.flatten(1) @ a.flatten(1)) * layer.scaling["x"]
            f = ours[key]
            assert torch.equal((f.b.flatten(1) @ f.a.flatten(1)) * f.scaling, theirs), (layout, key)


OTHER = {"sd": "flux", "sdxl": "sd", "flux": "sd"}     # a file made for another architecture than the served one


@pytest.mark.parametrize("kind", list(GUIDANCE))
def test_a_file_for_another_architecture_is_refused_naming_the_file_and_a_key(tiny_model, files, kind):
    engine = make_engine(tiny_model(kind), {}, "step")
    try:
        for layout in LAYOUTS:
            path = files[(OTHER[kind], layout)]
            with pytest.raises(LoraLoadError) as exc:
                engine.collective_rpc("load_lora", ("x", path))
            message = str(exc.value)
            assert message.startswith(f"LoRA adapter 'x' from '{path}"), message
            assert "key '" in message or any(stem in message for stem in key_stems(path)), message
        assert engine.collective_rpc("list_loras") == []
        assert runner_of(engine).adapter.loras.adapters == {}
    finally:
        engine.close()


def key_stems(path: str) -> set[str]:
    """The module part of each of the file's keys (diffusers' own refusals quote the file's keys)."""
    from pathlib import Path

    file = Path(path) if Path(path).is_file() else Path(path) / "pytorch_lora_weights.safetensors"
    with safe_open(str(file), framework="pt") as f:
        return {key.split(".")[0] for key in f.keys()}
