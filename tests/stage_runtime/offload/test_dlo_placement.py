"""DLO on an accelerator never holds the whole denoiser on the device, at load either: the runner loads the pipeline on
the host (offload.load_device), puts what DLO does not shard on the device (place_unsharded), and the GatherTier cuts
each rank's shard into device memory from the host bytes, then moves the unit's tensors (the same objects) to the
device, empty, dropping the host copy. ``meta`` stands for the device where only placement matters; the tier's move
rebinds Parameters in place (``.data``), which torch allows between dense devices (CPU, CUDA …) only, so that test
runs where CUDA is (the GPU check's DLO row runs the whole path on a device)."""

from __future__ import annotations

import pytest
import torch

from stage_runtime.config import ModelConfig, OffloadConfig
from stage_runtime.models.registry import resolve_adapter_class
from stage_runtime.offload import load_device, place_unsharded, sharded_components
from stage_runtime.offload.gather import GatherTier
from stage_runtime.offload.plan import resolve_units

DLO = OffloadConfig(mode="distributed")
DEVICE = torch.device("meta")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the host-to-device move needs one")


@pytest.fixture
def adapter(tiny_sd_path):
    return resolve_adapter_class(ModelConfig(path=tiny_sd_path)).load(tiny_sd_path, torch.device("cpu"))


@pytest.mark.parametrize("config, device, expected", [
    (DLO, "cuda", "cpu"), (DLO, "cpu", "cpu"), (OffloadConfig(mode="layerwise"), "cuda", "cuda"),
    (OffloadConfig(mode="distributed", allgather=False), "cuda", "cuda"), (OffloadConfig(), "cuda", "cuda")])
def test_only_dlo_on_an_accelerator_loads_on_the_host(config, device, expected):
    assert load_device(config, torch.device(device)) == torch.device(expected)


def test_what_dlo_does_not_shard_goes_to_the_device_and_the_denoiser_waits_on_the_host(adapter):
    assert sharded_components(DLO, adapter) == ("unet",)
    place_unsharded(DLO, adapter, DEVICE)
    assert adapter.device == DEVICE
    assert {p.device.type for p in adapter.pipe.unet.parameters()} == {"cpu"}
    for name in ("vae", "text_encoder"):
        assert {p.device.type for p in getattr(adapter.pipe, name).parameters()} == {"meta"}, name


@CUDA
def test_the_gather_tier_cuts_the_shard_on_the_device_and_moves_the_same_tensors_there_empty(adapter):
    device = torch.device("cuda", 0)
    unet = adapter.pipe.unet
    before = {name: (id(p), p.dtype, tuple(p.shape)) for name, p in unet.named_parameters()}
    host_bytes = sum(p.numel() * p.element_size() for p in unet.parameters())
    units = resolve_units(adapter.pipe, unet, "layerwise", ())
    tier = GatherTier(device, None, rank=0, world=2)
    tier.prepare(units)
    assert {(name, id(p), p.dtype) for name, p in unet.named_parameters()} == {
        (name, i, dtype) for name, (i, dtype, _) in before.items()}, "the same Parameter objects"
    assert {p.device for p in unet.parameters()} == {device}
    assert all(p.numel() == 0 for p in unet.parameters()), "nothing of the host copy is held"
    assert all(layout.shard.device == device for layout in tier.layouts.values())
    assert 0.5 * host_bytes <= tier.held_bytes() <= 0.55 * host_bytes
    assert {p.device.type for p in adapter.pipe.vae.parameters()} == {"cpu"}, "only the units move"


def test_on_the_device_it_loaded_on_the_tier_keeps_the_tensors_where_they_are(adapter):
    unet = adapter.pipe.unet
    units = resolve_units(adapter.pipe, unet, "layerwise", ())
    tier = GatherTier(torch.device("cpu"), None, rank=1, world=2)
    tier.prepare(units)
    assert all(p.device.type == "cpu" and p.numel() > 0 for p in unet.parameters()), "the release frees them, not prepare"
    assert all(g.device == torch.device("cpu") for u in units for g in u.groups)
