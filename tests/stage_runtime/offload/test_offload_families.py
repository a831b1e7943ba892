"""Layerwise offload on SDXL (UNet down/mid/up blocks), Qwen-Image (dual-stream transformer blocks), Z-Image (its main
single-stream layers; the refiners stay with the head), FLUX.2 [klein] (double- then single-stream blocks) and Wan
(each expert's blocks: Wan 2.1's one transformer, Wan 2.2's two): the families declare their block lists, and the engine's
images and videos with offload equal those without, bitwise, in request and step mode; the offloader holds nothing
once idle and leaves no mapping behind."""

from __future__ import annotations

import pytest
import torch
from engine_probes import max_diff, runner_of, wait_until
from offload_probes import offload_mappings

from stage_runtime.config import load_config
from stage_runtime.engine.engine import DiffusionEngine
from stage_runtime.errors import ConfigError
from stage_runtime.models.families.flux2_klein import Flux2KleinAdapter
from stage_runtime.models.families.qwen_image import QwenImageAdapter
from stage_runtime.models.families.sdxl import StableDiffusionXLAdapter
from stage_runtime.models.families.wan import WanAdapter
from stage_runtime.models.families.zimage import ZImageAdapter
from stage_runtime.offload.plan import denoiser_blocks, resolve_units
from stage_runtime.request import DiffusionRequest, SamplingParams

torch.set_num_threads(1)
IMAGE = {"height": 64, "width": 64}
VIDEO = {"height": 16, "width": 16, "num_frames": 9}
# family: (adapter, fixture, the components split into blocks and their block count, request fields, step counts;
# Wan 2.2's 6 steps are high-noise for 2, its 2 steps for 1: the second tick runs one request on each expert)
FAMILIES = {"sdxl": (StableDiffusionXLAdapter, "tiny_sdxl_path", {"unet": 2 + 1 + 2}, IMAGE, (4, 3)),
            "qwen-image": (QwenImageAdapter, "tiny_qwen_image_path", {"transformer": 2}, IMAGE, (4, 3)),
            "zimage": (ZImageAdapter, "tiny_zimage_path", {"transformer": 2}, IMAGE, (4, 3)),
            "flux2-klein": (Flux2KleinAdapter, "tiny_flux2_klein_path", {"transformer": 1 + 2}, IMAGE, (4, 3)),
            "wan": (WanAdapter, "tiny_wan_path", {"transformer": 2}, VIDEO, (3, 2)),
            "wan22": (WanAdapter, "tiny_wan22_path", {"transformer": 2, "transformer_2": 2}, VIDEO, (6, 2))}


def engine(path: str, mode: str, offload: dict | None = None) -> DiffusionEngine:
    return DiffusionEngine.make_engine(load_config({
        "model": {"path": path}, "device": "cpu", "executor": "uni", "warmup": False,
        "scheduler": {"execution_mode": mode, "max_num_seqs": 2}, "offload": offload or {}}))


def scenario(eng, family: str) -> dict:
    """Two requests of different step counts (batched in step mode, separate waves in request mode); on Wan 2.2 both
    run both experts, and in step mode share ticks where one is on each."""
    fields, (long, short) = FAMILIES[family][3], FAMILIES[family][4]

    def request(rid, prompt, steps, seed, **kw):
        video = "num_frames" in fields
        return DiffusionRequest(rid, prompt, SamplingParams(num_inference_steps=steps, seed=seed, **fields, **kw),
                                video=video)

    streams = [eng.add_request(request("a", "a red fox", long, 1, num_outputs=2)),
               eng.add_request(request("b", "a blue car", short, 2, negative_prompt="a dog"))]
    return {s.request_id: s.result(timeout=120).images for s in streams}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_family_declares_its_block_lists(request, family):
    cls, fixture, split, _, _ = FAMILIES[family]
    adapter = cls.load(request.getfixturevalue(fixture), torch.device("cpu"))
    holders = adapter.block_holders()
    assert list(holders) == list(split)
    units = resolve_units(adapter.pipe, tuple(holders.values()), "layerwise", (), cls.block_lists)
    for name, module in holders.items():
        declared = [b for attr in cls.block_lists for b in
                    (getattr(module, attr) if isinstance(getattr(module, attr), torch.nn.ModuleList)
                     else [getattr(module, attr)])]
        assert denoiser_blocks(module, cls.block_lists) == declared
        names = [u.name for u in units if u.component == name]
        assert names == [f"{name}.head"] + [f"{name}.block{i}" for i in range(len(declared))]
        assert len(declared) == split[name]
    with pytest.raises(ConfigError, match="has no block list 'no_such_blocks'"):      # a name no denoiser has
        denoiser_blocks(next(iter(holders.values())), ("no_such_blocks",))


@pytest.mark.parametrize("mode", ["request", "step"])
@pytest.mark.parametrize("family", FAMILIES)
def test_layerwise_offload_equals_no_offload_bitwise(request, family, mode):
    path = request.getfixturevalue(FAMILIES[family][1])
    plain = engine(path, mode)
    try:
        reference = scenario(plain, family)
    finally:
        plain.close()
    eng = engine(path, mode, {"mode": "layerwise"})
    parts = runner_of(eng).adapter.block_holders()
    calls = {name: 0 for name in ("step", *parts)}
    hooks = [module.register_forward_pre_hook(lambda _m, _a, k=name: calls.__setitem__(k, calls[k] + 1))
             for name, module in (("step", runner_of(eng).adapter.denoiser), *parts.items())]
    try:
        images = scenario(eng, family)
        if family == "wan22" and mode == "step":       # one tick ran a request on each expert
            assert (calls["step"], calls["transformer"], calls["transformer_2"]) == (6, 2, 5)
        for rid, ref in reference.items():
            assert max_diff(images[rid], ref) == 0, rid
        offloader = runner_of(eng).offloader
        wait_until(lambda: eng.num_request_states() == 0, timeout=10)
        wait_until(lambda: offloader.manager.measured_resident_bytes() == 0, timeout=5)
        stats = eng.collective_rpc("offload_stats")[0]
        assert stats["mode"] == "layerwise" and stats["loads"] > 0 and stats["resident_bytes"]["cpu"] == 0
    finally:
        for hook in hooks:
            hook.remove()
        eng.close()
    assert offload_mappings() == []
