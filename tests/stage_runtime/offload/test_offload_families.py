"""Layerwise offload on SDXL (UNet down/mid/up blocks) and Qwen-Image (dual-stream transformer blocks): the
families declare their block lists, and the engine's images with offload equal those without, bitwise, in
request and step mode; the offloader holds nothing once idle and leaves no mapping behind."""

from __future__ import annotations

import pytest
import torch
from engine_probes import max_diff, runner_of, wait_until
from offload_probes import offload_mappings

from stage_runtime.config import load_config
from stage_runtime.engine.engine import DiffusionEngine
from stage_runtime.errors import ConfigError
from stage_runtime.models.qwen_image import QwenImageAdapter
from stage_runtime.models.sdxl import StableDiffusionXLAdapter
from stage_runtime.offload.plan import denoiser_blocks, resolve_units
from stage_runtime.request import DiffusionRequest, SamplingParams

torch.set_num_threads(1)
FAMILIES = {"sdxl": (StableDiffusionXLAdapter, "tiny_sdxl_path", 3), "qwen-image": (QwenImageAdapter,
                                                                                      "tiny_qwen_image_path", 2)}


def engine(path: str, mode: str, offload: dict | None = None) -> DiffusionEngine:
    return DiffusionEngine.make_engine(load_config({
        "model": {"path": path}, "device": "cpu", "executor": "uni", "warmup": False,
        "scheduler": {"execution_mode": mode, "max_num_seqs": 2}, "offload": offload or {}}))


def scenario(eng) -> dict:
    """Two requests of different step counts (batched in step mode, separate waves in request mode)."""
    def request(rid, prompt, steps, seed, **kw):
        return DiffusionRequest(rid, prompt, SamplingParams(num_inference_steps=steps, seed=seed, height=64, width=64,
                                                            **kw))

    streams = [eng.add_request(request("a", "a red fox", 4, 1, num_outputs=2)),
               eng.add_request(request("b", "a blue car", 3, 2, negative_prompt="a dog"))]
    return {s.request_id: s.result(timeout=120).images for s in streams}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_family_declares_its_block_lists(request, family):
    cls, fixture, blocks = FAMILIES[family]
    adapter = cls.load(request.getfixturevalue(fixture), torch.device("cpu"))
    declared = [b for attr in cls.block_lists for b in
                (getattr(adapter.denoiser, attr) if isinstance(getattr(adapter.denoiser, attr), torch.nn.ModuleList)
                 else [getattr(adapter.denoiser, attr)])]
    assert denoiser_blocks(adapter.denoiser, cls.block_lists) == declared
    units = resolve_units(adapter.pipe, adapter.denoiser, "layerwise", (), cls.block_lists)
    denoiser_name = "unet" if family == "sdxl" else "transformer"
    names = [u.name for u in units if u.component == denoiser_name]
    assert names == [f"{denoiser_name}.head"] + [f"{denoiser_name}.block{i}" for i in range(len(declared))]
    assert len(declared) == {"sdxl": 2 + 1 + 2, "qwen-image": 2}[family]
    with pytest.raises(ConfigError, match="has no block list 'single_transformer_blocks'"):
        denoiser_blocks(adapter.denoiser, ("single_transformer_blocks",))


@pytest.mark.parametrize("mode", ["request", "step"])
@pytest.mark.parametrize("family", FAMILIES)
def test_layerwise_offload_equals_no_offload_bitwise(request, family, mode):
    path = request.getfixturevalue(FAMILIES[family][1])
    plain = engine(path, mode)
    try:
        reference = scenario(plain)
    finally:
        plain.close()
    eng = engine(path, mode, {"mode": "layerwise"})
    try:
        images = scenario(eng)
        for rid, ref in reference.items():
            assert max_diff(images[rid], ref) == 0, rid
        offloader = runner_of(eng).offloader
        wait_until(lambda: eng.num_request_states() == 0, timeout=10)
        wait_until(lambda: offloader.manager.measured_resident_bytes() == 0, timeout=5)
        stats = eng.collective_rpc("offload_stats")[0]
        assert stats["mode"] == "layerwise" and stats["loads"] > 0 and stats["resident_bytes"]["cpu"] == 0
    finally:
        eng.close()
    assert offload_mappings() == []
