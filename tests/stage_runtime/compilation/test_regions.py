"""What each family compiles (compilation.regions), how a compiled module's forward is installed, and the refusals
at load; the calls that must run eagerly (Compiler.eager_reason); the block cache leaving a compiled block's forward
in place (regression: it popped the instance ``forward``, dropping the compiled one after the first cached call).
Nothing here compiles: torch.compile is lazy, and these tests never call a compiled region."""

from __future__ import annotations

import pytest
import torch
from lora_probes import write_adapter

from stage_runtime.compilation import install_compiler
from stage_runtime.compilation.regions import CompiledForward, find_regions, uninstall
from stage_runtime.config import ConfigError, ModelConfig, load_config
from stage_runtime.models import block_cache
from stage_runtime.models.lora.manager import build_lora_manager
from stage_runtime.models.registry import resolve_adapter_class
from stage_runtime.request import DiffusionRequest, SamplingParams

# kind → (class name → modules) of regional compilation: the model's _repeated_blocks, else the family's
REGIONAL = {
    "dit": {"BasicTransformerBlock": 2},                                    # the family's compile_blocks
    "sd3": {"JointTransformerBlock": 2},                                    # the family's compile_blocks
    "sd": {"BasicTransformerBlock": 4},                                     # UNet2DConditionModel._repeated_blocks
    "flux": {"FluxTransformerBlock": 1, "FluxSingleTransformerBlock": 1},  # both classes, one function each
    "wan22": {"WanTransformerBlock": 4},                                    # both experts' blocks
    "ltx2": {"LTX2VideoTransformerBlock": 2},                               # inside the family's row router
}


def load(path: str):
    return resolve_adapter_class(ModelConfig(path=path)).load(path, torch.device("cpu"))


def stage(path: str, **sections):
    return load_config({"model": {"path": path}, "device": "cpu", **sections})


@pytest.mark.parametrize("kind", list(REGIONAL))
def test_regional_compiles_each_repeated_block_class_once(kind, tiny_model):
    adapter = load(tiny_model(kind))
    regions = find_regions(adapter, "regional")
    assert {r.name: len(r.modules) for r in regions} == REGIONAL[kind]
    assert all(len({type(m) for m in r.modules}) == 1 for r in regions)
    full = find_regions(adapter, "full")
    assert [r.name for r in full] == list(adapter.block_holders())


def test_install_gives_each_module_a_compiled_forward_and_close_takes_it_back(tiny_dit_path):
    adapter = load(tiny_dit_path)
    compiler = install_compiler(adapter, stage(tiny_dit_path, compile={"mode": "regional"}), torch.device("cpu"))
    blocks = list(adapter.denoiser.transformer_blocks)
    assert all(isinstance(b.__dict__["forward"], CompiledForward) for b in blocks)
    assert compiler.stats()["regions"] == [{"name": "BasicTransformerBlock", "modules": len(blocks)}]
    uninstall(compiler.regions)
    assert not any("forward" in b.__dict__ for b in blocks)


def test_the_block_cache_puts_a_compiled_block_forward_back(tiny_dit_path):
    adapter = load(tiny_dit_path)
    install_compiler(adapter, stage(tiny_dit_path, compile={"mode": "regional"}), torch.device("cpu"))
    own = [b.forward for b in adapter.denoiser.transformer_blocks]
    cache = block_cache.BlockCacheState(block_cache.BlockCachePolicy(0.5), 4)
    with block_cache.session(adapter, block_cache.segments([(cache, 0, 1)])):
        assert all(b.forward is not f for b, f in zip(adapter.denoiser.transformer_blocks, own))
    assert [b.forward for b in adapter.denoiser.transformer_blocks] == own


def test_a_family_without_repeated_blocks_is_refused_for_regional(tiny_dit_path, monkeypatch):
    adapter = load(tiny_dit_path)
    monkeypatch.setattr(type(adapter), "compile_blocks", ())
    with pytest.raises(ConfigError) as info:
        find_regions(adapter, "regional")
    assert "DiTPipeline's transformer (DiTTransformer2DModel) declares no repeated blocks" in str(info.value)
    assert "use compile.mode=full" in str(info.value)


def test_model_offload_of_the_denoiser_is_refused_and_of_the_rest_allowed(tiny_sd_path):
    adapter = load(tiny_sd_path)
    for components in ([], ["unet", "vae"]):
        with pytest.raises(ConfigError) as info:
            install_compiler(adapter, stage(tiny_sd_path, compile={"mode": "regional"},
                                            offload={"mode": "model", "components": components}), torch.device("cpu"))
        assert "with offload.mode='model' over the denoiser (unet)" in str(info.value)
    assert install_compiler(adapter, stage(tiny_sd_path, compile={"mode": "regional"},
                                           offload={"mode": "model", "components": ["vae", "text_encoder"]}),
                            torch.device("cpu")) is not None


def test_auto_without_a_measurement_runs_eagerly_and_says_which(tiny_sd_path):
    adapter = load(tiny_sd_path)
    compiler = install_compiler(adapter, stage(tiny_sd_path, compile={"mode": "auto"}), torch.device("cuda:0"))
    stats = compiler.stats()
    assert stats["mode"] == "auto" and stats["mode_effective"] == "none" and stats["regions"] == []
    assert stats["auto"].startswith("no compile measurement of StableDiffusionPipeline on cuda")
    assert "forward" not in adapter.denoiser.__dict__


@pytest.mark.parametrize("mode", ["regional", "full"])
def test_which_calls_run_eagerly(mode, tiny_sd_path, tmp_path):
    adapter = load(tiny_sd_path)
    compiler = install_compiler(adapter, stage(tiny_sd_path, compile={"mode": mode}), torch.device("cpu"))
    loras = build_lora_manager(adapter, stage(tiny_sd_path), torch.device("cpu"))
    loras.load("ink", write_adapter(tiny_sd_path, tmp_path / "ink", seed=1))

    def request(*names):
        return DiffusionRequest("r", "p", SamplingParams(loras=tuple({"name": n, "scale": 1.0} for n in names)))

    assert compiler.eager_reason([request(), request("ink")], loras, cached=False) == "lora"
    assert compiler.eager_reason([request(), request()], loras, cached=False) is None
    assert compiler.eager_reason([request()], None, cached=False) is None
    assert compiler.eager_reason([request()], None, cached=True) == (None if mode == "regional" else "block_cache")
    with compiler.eager("lora"):
        assert compiler.stats()["eager_calls"] == {"lora": 1}


def test_the_startup_budget_bounds_the_warm_up_compile(tiny_dit_path):
    adapter = load(tiny_dit_path)
    compiler = install_compiler(adapter, stage(tiny_dit_path, compile={"mode": "regional", "timeout_s": 900}),
                                torch.device("cpu"))
    compiler.begin_warmup(budget_s=0.0)              # the startup budget is spent: not one graph is compiled
    block = adapter.denoiser.transformer_blocks[0]
    hidden = torch.randn(1, 16, block.attn1.to_q.in_features)
    with torch.inference_mode():
        out = block(hidden, timestep=torch.tensor([10]), class_labels=torch.tensor([3]))
        eager = block.forward.eager(hidden, timestep=torch.tensor([10]), class_labels=torch.tensor([3]))
    assert torch.equal(out, eager)
    stats = compiler.stats()
    assert stats["mode_effective"] == "none" and stats["graphs"] == 0, stats
    assert stats["reason"] == ("the warm-up compile ran past 0 s, what the startup budget left "
                               "(compile.timeout_s=900)")
