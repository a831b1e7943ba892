"""LoRA on LTX-2 (models/families/ltx2.py), the components of diffusers' LTX2LoraLoaderMixin: ``transformer`` (every guidance
pass's rows of one fused forward: [uncond; cond; perturbed; isolated], video and audio streams) and ``connectors``
(the text connectors, once per prompt: [negative; prompt] rows). A file holding both, in PEFT keys, is served per row
beside a request without it in one step-mode tick and in one request-mode wave, each equal to diffusers'
``load_lora_weights`` + ``set_adapters`` of the same file (frames; step mode within 2 uint8, request mode 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_probes import max_diff
from family_checks import Family, bare_call, bare_pipeline

from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine

FAMILY = Family("ltx2", guidances=(3.0, 5.0), size=64, frames=9)
TARGETS = {"transformer": ("attn1.to_q", "attn1.to_v", "attn2.to_k", "ff.net.0.proj", "ff.net.2"),
           "connectors": ("attn1.to_q", "attn1.to_out.0", "ff.net.0.proj")}
SCALE, STEPS, GUIDANCE = 0.9, 3, 3.0


def adapter_file(path: str, out: Path, seed: int, gain: float = 1.0) -> str:
    """Random rank-4 factors on the transformer's and the connectors' linears, in PEFT keys (no metadata: rank and
    alpha from the shapes, as diffusers infers them)."""
    from safetensors.torch import save_file

    pipe, generator, tensors = bare_pipeline(path), torch.Generator().manual_seed(seed), {}
    for component, suffixes in TARGETS.items():
        for name, module in getattr(pipe, component).named_modules():
            if isinstance(module, torch.nn.Linear) and name.endswith(suffixes):
                tensors[f"{component}.{name}.lora_A.weight"] = torch.randn(
                    4, module.in_features, generator=generator) / module.in_features ** 0.5 * gain
                tensors[f"{component}.{name}.lora_B.weight"] = torch.randn(
                    module.out_features, 4, generator=generator) * gain
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "pytorch_lora_weights.safetensors"))
    return str(out)


def reference(path: str, adapter: str | None, seed: int):
    pipe = bare_pipeline(path)
    if adapter is None:
        return bare_call(FAMILY, path, "a cat playing piano", STEPS, seed, GUIDANCE)
    pipe.load_lora_weights(adapter, adapter_name="x")
    try:
        pipe.set_adapters(["x"], [SCALE])
        return bare_call(FAMILY, path, "a cat playing piano", STEPS, seed, GUIDANCE)
    finally:
        pipe.unload_lora_weights()


@pytest.mark.parametrize("mode", ["step", "request"])
def test_a_transformer_and_connectors_adapter_is_served_per_row_equal_to_diffusers(tiny_ltx2_path, tmp_path, mode):
    adapter = adapter_file(tiny_ltx2_path, tmp_path / "ltx-lora", seed=3)
    engine = DiffusionEngine.make_engine(load_config({
        "model": {"path": tiny_ltx2_path}, "device": "cpu", "warmup": False, "loras": [{"name": "x", "path": adapter}],
        "scheduler": {"execution_mode": mode, "max_num_seqs": 2, "request_batch_max_wait_ms": 300}}))
    try:
        listed = engine.collective_rpc("list_loras")[0]
        with engine._lock:                        # admitted together: one tick (step) or one wave (request)
            streams = {rid: engine.add_request(FAMILY.request(
                rid, "a cat playing piano", STEPS, seed, guidance_scale=GUIDANCE, loras=loras))
                for rid, seed, loras in (("plain", 1, []), ("adapted", 2, [{"name": "x", "scale": SCALE}]))}
        got = {rid: s.result(timeout=300).images for rid, s in streams.items()}
    finally:
        engine.close()
    assert set(listed["modules"]) == {"transformer", "connectors"} and all(listed["modules"].values())
    tolerance = 2 if mode == "step" else 1
    assert max_diff(got["plain"], reference(tiny_ltx2_path, None, 1)) <= tolerance
    assert max_diff(got["adapted"], reference(tiny_ltx2_path, adapter, 2)) <= tolerance
    assert max_diff(reference(tiny_ltx2_path, adapter, 2), reference(tiny_ltx2_path, None, 2)) > 2, \
        "the adapter changes the video"
