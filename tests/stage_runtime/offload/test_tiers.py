"""The two tiers on real tiny components: release really frees the storages, load brings back the same bytes
into the same Parameter objects (any number of round trips), the disk tier leaves no file, folder or
descriptor behind and drops its mappings at close."""

from __future__ import annotations

import os

import pytest
import torch
from diffusers import DiffusionPipeline

from offload_probes import bitwise_equal, materialised_bytes, fds_opened_since, offload_mappings, open_fds, snapshot
from stage_runtime.offload.plan import resolve_units
from stage_runtime.offload.tiers import DiskTier, HostTier


@pytest.fixture
def sd_pipe(tiny_sd_path):
    return DiffusionPipeline.from_pretrained(tiny_sd_path, local_files_only=True, low_cpu_mem_usage=False)


def identities(module: torch.nn.Module) -> dict[str, tuple]:
    return {n: (id(t), t.dtype, t.shape, t.device, t.requires_grad)
            for n, t in [*module.named_parameters(), *module.named_buffers()]}


@pytest.mark.parametrize("tier_kind, dtype", [("disk", None), ("host", None), ("disk", torch.float16),
                                               ("disk", torch.bfloat16)])
def test_round_trips_are_bitwise_and_keep_identity(sd_pipe, tmp_path, tier_kind, dtype):
    if dtype is not None:
        sd_pipe.to(dtype)                     # buffers of other dtypes (e.g. int64 position ids) stay as they are
    modules = [sd_pipe.unet, sd_pipe.vae, sd_pipe.text_encoder]
    units = resolve_units(sd_pipe, sd_pipe.unet, "layerwise", ())
    before = [snapshot(m) for m in modules]
    ids = [identities(m) for m in modules]
    fds = open_fds()
    tier = DiskTier(str(tmp_path)) if tier_kind == "disk" else HostTier(torch.device("cpu"))
    tier.prepare(units)
    assert os.listdir(tmp_path) == []                    # written once, mapped, unlinked, folder removed
    total = materialised_bytes(modules)
    assert total == sum(u.nbytes for u in units)
    for _ in range(25):
        for unit in units:
            tier.release(unit)
        assert materialised_bytes(modules) == 0          # really freed: every storage is 0 bytes
        for unit in units:
            with torch.no_grad():
                tier.load(unit)
        assert materialised_bytes(modules) == total
    for module, snap, ident in zip(modules, before, ids, strict=True):
        assert identities(module) == ident
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            assert bitwise_equal(t, snap[name]), name
    assert fds_opened_since(fds) == {}                   # no descriptor kept: the mappings hold the bytes
    held = tier.held_bytes()
    assert held == (0 if tier_kind == "disk" else total)
    if tier_kind == "disk":
        assert len(offload_mappings()) >= 1
    tier.close()
    assert offload_mappings() == [] and tier.held_bytes() == 0


def test_load_fills_only_the_units_own_storages(sd_pipe, tmp_path):
    units = resolve_units(sd_pipe, sd_pipe.unet, "model", ())
    tier = DiskTier(str(tmp_path))
    tier.prepare(units)
    try:
        for unit in units:
            tier.release(unit)
        vae = next(u for u in units if u.name == "vae")
        tier.load(vae)
        assert materialised_bytes([sd_pipe.vae]) == vae.nbytes
        assert materialised_bytes([sd_pipe.unet, sd_pipe.text_encoder]) == 0
    finally:
        tier.close()
