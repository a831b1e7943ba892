"""GGUF denoisers (quantization/gguf.py): the tiny FLUX.1 and Wan 2.1 denoisers written as Q8_0 GGUF files
(``make-tiny-model --gguf``), served by the real engine under ``quantization: {method: gguf, file}`` (the model
runner loads through ``load_gguf_pipeline``), against the bare
diffusers pipeline whose denoiser diffusers reads from the same file (same seed): request mode within 1 uint8, step
mode within 2. The weights stay quantized (GGUFParameter, Q8_0) and take fewer bytes than the float32 denoiser.
(What is refused: test_gguf_refusals.py; the writer and its layouts: models/test_tiny_gguf.py.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import diffusers
import pytest
import torch
from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter
from engine_probes import assert_no_state, count_denoiser_calls, max_diff, runner_of
from family_checks import RESULT_TIMEOUT, Family, generators, make_engine, to_uint8
from gguf import GGMLQuantizationType

from stage_runtime.cli import main as cli_main
from stage_runtime.config import ModelConfig, QuantizationConfig, load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.models.families.flux import FluxAdapter
from stage_runtime.quantization.gguf import load_gguf_pipeline
from stage_runtime.quantization.weight_bytes import module_bytes

torch.set_num_threads(1)
FLUX = Family("flux", guidances=(3.5, 6.0))
WAN = Family("wan", guidances=(6.0, 3.0), size=16, frames=9)
GGUF_FILE = "transformer.Q8_0.gguf"          # make-tiny-model --gguf Q8_0 writes it inside the folder
GGUF = {"method": "gguf", "file": GGUF_FILE}
PIPELINES = {"flux": "FluxPipeline", "wan": "WanPipeline"}
_BARE: dict[str, diffusers.DiffusionPipeline] = {}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """kind → a tiny pipeline folder with its denoiser beside it as transformer.Q8_0.gguf, by the CLI."""
    built = {}
    for kind in ("flux", "wan"):
        out = tmp_path_factory.mktemp("gguf") / f"tiny-{kind}"
        assert cli_main(["make-tiny-model", str(out), "--kind", kind, "--gguf", "Q8_0"]) == 0
        built[kind] = str(out)
    return built


def bare_pipeline(folder: str, kind: str) -> diffusers.DiffusionPipeline:
    """The pipeline diffusers alone builds: its transformer from the GGUF file (diffusers' own loader)."""
    if folder not in _BARE:
        model = getattr(diffusers, PIPELINES[kind]).load_config(folder)["transformer"][-1]
        transformer = getattr(diffusers, model).from_single_file(
            str(Path(folder) / GGUF_FILE), config=folder, subfolder="transformer", local_files_only=True,
            quantization_config=diffusers.GGUFQuantizationConfig(compute_dtype=torch.float32))
        pipe = getattr(diffusers, PIPELINES[kind]).from_pretrained(folder, transformer=transformer,
                                                                  local_files_only=True)
        pipe.set_progress_bar_config(disable=True)
        _BARE[folder] = pipe
    return _BARE[folder]


def bare_call(family: Family, folder: str, prompt: str, steps: int, seed: int, guidance: float, n: int = 1):
    pipe = bare_pipeline(folder, family.kind)
    video = {} if family.frames is None else {"num_frames": family.frames}
    out = pipe(prompt=[prompt] * n, guidance_scale=guidance, height=family.size, width=family.size, **video,
               num_inference_steps=steps, generator=generators(seed, n), output_type="np")
    return to_uint8(out.images if family.frames is None else out.frames)


def served_transformer(engine) -> torch.nn.Module:
    return runner_of(engine).adapter.pipe.transformer


def assert_q8_0_linears(transformer: torch.nn.Module) -> int:
    """Every linear layer of the repeated blocks is diffusers' GGUFLinear over a Q8_0 GGUFParameter; their count."""
    blocks = [(n, m) for n, m in transformer.named_modules() if "blocks." in n and isinstance(m, torch.nn.Linear)]
    assert blocks
    for name, layer in blocks:
        assert isinstance(layer, GGUFLinear) and isinstance(layer.weight, GGUFParameter), name
        assert layer.weight.quant_type == GGMLQuantizationType.Q8_0 and layer.weight.dtype == torch.uint8, name
    return len(blocks)


@pytest.mark.parametrize("family", [FLUX, WAN], ids=["flux", "wan"])
def test_a_q8_0_denoiser_in_request_mode_equals_the_bare_pipeline_on_the_same_file(folders, family):
    folder = folders[family.kind]
    g = family.guidances[0]
    eng = make_engine(folder, "request", quantization=GGUF, warmup=False, max_num_seqs=2,
                      request_batch_max_wait_ms=200)
    calls = count_denoiser_calls(eng)
    try:
        assert_q8_0_linears(served_transformer(eng))
        report = runner_of(eng).weights.components["transformer"]           # /v1/stats.weights' entry
        assert report == {"bytes": module_bytes(served_transformer(eng)), "method": "gguf"}
        with eng._lock:              # admitted together: one wave, whatever the machine's speed
            a = eng.add_request(family.request("a", "a photo of a cat", 3, 1, guidance_scale=g))
            b = eng.add_request(family.request("b", "a red car", 3, 2, num_outputs=2, guidance_scale=g))
        out_a, out_b = a.result(timeout=RESULT_TIMEOUT), b.result(timeout=RESULT_TIMEOUT)
        assert calls[0] == 3, f"{calls[0]} denoiser forwards for two 3-step requests: they were not fused"
        assert max_diff(out_a.images, bare_call(family, folder, "a photo of a cat", 3, 1, g)) <= 1
        assert max_diff(out_b.images, bare_call(family, folder, "a red car", 3, 2, g, n=2)) <= 1
        assert out_a.images.std() > 5 and max_diff(out_a.images, out_b.images[:1]) > 20
        assert_no_state(eng)
    finally:
        eng.close()


@pytest.mark.parametrize("family", [FLUX, WAN], ids=["flux", "wan"])
def test_a_q8_0_denoiser_in_step_mode_equals_the_bare_pipeline_on_the_same_file(folders, family):
    """Requests of different step counts and guidance share ticks; each within 2 of its bare call."""
    folder = folders[family.kind]
    eng = make_engine(folder, "step", quantization=GGUF, warmup=False, max_num_seqs=4)
    calls = count_denoiser_calls(eng)
    try:
        g1, g2 = family.guidances
        with eng._lock:
            long = eng.add_request(family.request("long", "a photo of a cat", 6, 3, guidance_scale=g1))
            short = eng.add_request(family.request("short", "a red car", 3, 4, num_outputs=2, guidance_scale=g2))
        long_out, short_out = long.result(timeout=RESULT_TIMEOUT), short.result(timeout=RESULT_TIMEOUT)
        assert calls[0] == 6, f"{calls[0]} denoiser forwards for 6 + 3 steps: the requests did not share ticks"
        assert max_diff(long_out.images, bare_call(family, folder, "a photo of a cat", 6, 3, g1)) <= 2
        assert max_diff(short_out.images, bare_call(family, folder, "a red car", 3, 4, g2, n=2)) <= 2
        assert_no_state(eng)
    finally:
        eng.close()


def test_the_q8_0_flux_denoiser_stays_quantized_in_fewer_bytes_than_float32(folders):
    folder = folders["flux"]
    adapter = load_gguf_pipeline(FluxAdapter, ModelConfig(path=folder),
                                 QuantizationConfig(method="gguf", file=GGUF_FILE), torch.device("cpu"))
    assert type(adapter) is FluxAdapter and adapter.denoiser is adapter.pipe.transformer
    linears = assert_q8_0_linears(adapter.denoiser)
    float32 = diffusers.FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer", local_files_only=True)
    quantized, full = module_bytes(adapter.denoiser), module_bytes(float32)
    # Q8_0: 34 bytes per 32 weights (1.06 B) in the blocks' linears; the embedders, the final layer, norms and biases
    # stay float32, a large share of a 32-wide model: 160768 / 314176 bytes (0.51) measured
    assert quantized < 0.6 * full, (quantized, full, linears)
    block_weights = sum(m.weight.numel() for n, m in float32.named_modules()
                        if "blocks." in n and isinstance(m, torch.nn.Linear))
    assert full - quantized == pytest.approx(block_weights * (4 - 34 / 32))


def test_the_folder_needs_the_denoisers_config_but_not_its_weights(folders, tmp_path):
    """A downloaded GGUF comes without the float transformer: the folder's transformer/ holds only config.json."""
    folder = tmp_path / "flux-without-weights"
    shutil.copytree(folders["flux"], folder, ignore=shutil.ignore_patterns("*.safetensors"))
    for component in ("vae", "text_encoder", "text_encoder_2"):
        shutil.copytree(Path(folders["flux"]) / component, folder / component, dirs_exist_ok=True)
    assert not list((folder / "transformer").glob("*.safetensors"))
    adapter = load_gguf_pipeline(FluxAdapter, ModelConfig(path=str(folder)),
                                 QuantizationConfig(method="gguf", file=GGUF_FILE), torch.device("cpu"))
    served = load_gguf_pipeline(FluxAdapter, ModelConfig(path=folders["flux"]),
                                QuantizationConfig(method="gguf", file=str(Path(folders["flux"]) / GGUF_FILE)),
                                torch.device("cpu"))
    for (name, mine), (_, theirs) in zip(adapter.denoiser.state_dict().items(), served.denoiser.state_dict().items()):
        assert torch.equal(mine, theirs), name


def test_a_lora_on_the_q8_0_denoiser_equals_diffusers_lora_on_the_same_file(folders):
    """An adapted row and a plain row in one tick: the adapted one within 2 of diffusers' own LoRA (PEFT) over the
    GGUF denoiser, the plain one within 2 of the bare call (the factors compute in the layer's compute dtype, not
    its stored bytes: regression, they were cast to uint8)."""
    folder, g = folders["flux"], FLUX.guidances[0]
    ink = str(Path(folder) / "loras" / "ink")
    eng = DiffusionEngine.make_engine(load_config({
        "model": {"path": folder}, "device": "cpu", "warmup": False, "quantization": GGUF,
        "loras": [{"name": "ink", "path": ink}], "scheduler": {"execution_mode": "step", "max_num_seqs": 4}}))
    try:
        with eng._lock:
            adapted = eng.add_request(FLUX.request("ink", "a photo of a cat", 3, 4, guidance_scale=g,
                                                   loras=({"name": "ink", "scale": 1.0},)))
            plain = eng.add_request(FLUX.request("plain", "a photo of a cat", 3, 4, guidance_scale=g))
        adapted, plain = adapted.result(timeout=RESULT_TIMEOUT).images, plain.result(timeout=RESULT_TIMEOUT).images
    finally:
        eng.close()
    assert max_diff(plain, bare_call(FLUX, folder, "a photo of a cat", 3, 4, g)) <= 2
    pipe = bare_pipeline(folder, "flux")
    pipe.load_lora_weights(ink, adapter_name="ink")
    try:
        assert max_diff(adapted, bare_call(FLUX, folder, "a photo of a cat", 3, 4, g)) <= 2
    finally:
        pipe.unload_lora_weights()
    assert max_diff(adapted, plain) > 5, "the adapter changed nothing"


def test_ulysses_over_two_ranks_on_the_q8_0_denoiser_equals_one_rank(folders):
    """Each rank reads the same GGUF file; the attention heads split across two gloo ranks: within 2 of one rank."""
    folder, g = folders["flux"], FLUX.guidances[0]
    images = {}
    for name, extra in (("one", {}), ("two", {"executor": "mp", "parallel": {"ulysses_degree": 2},
                                              "collective_timeout_s": 300})):
        eng = DiffusionEngine.make_engine(load_config({
            "model": {"path": folder}, "device": "cpu", "warmup": False, "quantization": GGUF,
            "scheduler": {"execution_mode": "step", "max_num_seqs": 2}, **extra}))
        try:
            images[name] = eng.add_request(FLUX.request(name, "a red car", 3, 6, guidance_scale=g)).result(
                timeout=RESULT_TIMEOUT).images
        finally:
            eng.close()
    assert max_diff(images["one"], images["two"]) <= 2
