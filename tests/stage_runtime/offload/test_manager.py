"""ResidencyManager on a real tiny pipeline and the real disk tier: one state per unit, ``ensure`` returns only
when the unit is resident (also while a slow prefetch is in flight), the resident bound is kept by evicting
unpinned units, a failed load leaves the unit released, accounting matches the storages, close is final."""

from __future__ import annotations

import pytest
from diffusers import DiffusionPipeline

from offload_probes import bitwise_equal, materialised_bytes, offload_mappings, snapshot
from stage_runtime.errors import WorkerFatalError
from stage_runtime.offload.manager import Residency, ResidencyManager
from stage_runtime.offload.plan import resolve_units
from stage_runtime.offload.tiers import DiskTier
from tiers_for_tests import BrokenDiskTier, SlowDiskTier


@pytest.fixture
def dit(tiny_dit_path):
    pipe = DiffusionPipeline.from_pretrained(tiny_dit_path, local_files_only=True, low_cpu_mem_usage=False)
    units = resolve_units(pipe, pipe.transformer, "layerwise", ())
    return pipe, units


def test_start_releases_all_and_ensure_materialises(dit):
    pipe, units = dit
    before = snapshot(pipe.transformer)
    m = ResidencyManager(units, DiskTier())
    m.start()
    try:
        assert set(m.state.values()) == {Residency.RELEASED} and m.measured_resident_bytes() == 0
        m.ensure("transformer.block1")
        assert m.state["transformer.block1"] is Residency.RESIDENT
        block1 = next(u for u in units if u.name == "transformer.block1")
        assert materialised_bytes([pipe.transformer.transformer_blocks[1]]) == block1.nbytes
        assert materialised_bytes([pipe.transformer.transformer_blocks[0]]) == 0
        assert m.measured_resident_bytes() == m._resident == block1.nbytes
        m.release("transformer.block1")
        m.release("transformer.block1")                       # releasing a released unit is a no-op
        assert m.measured_resident_bytes() == 0 and m.stats()["loads"] == 1
        for unit in units:
            m.ensure(unit.name)
        for name, t in [*pipe.transformer.named_parameters(), *pipe.transformer.named_buffers()]:
            assert bitwise_equal(t, before[name]), name
    finally:
        m.close()
    assert m.measured_resident_bytes() == 0 and offload_mappings() == []
    m.close()                                                  # idempotent


def test_ensure_waits_for_the_prefetch_in_flight(dit):
    pipe, units = dit
    before = snapshot(pipe.transformer)
    tier = SlowDiskTier(delay_s=0.2)
    m = ResidencyManager(units, tier, prefetch=True)
    m.start()
    try:
        m.prefetch("transformer.block0")
        assert tier.loading.wait(5)
        assert m.state["transformer.block0"] is Residency.LOADING
        assert materialised_bytes([pipe.transformer.transformer_blocks[0]]) == 0     # not ready: nothing there
        m.ensure("transformer.block0")                                                # must block until loaded
        assert m.state["transformer.block0"] is Residency.RESIDENT
        for name, t in pipe.transformer.transformer_blocks[0].named_parameters():
            assert bitwise_equal(t, before[f"transformer_blocks.0.{name}"])
        assert m.stats()["prefetch_waits"] == 1
        m.prefetch("transformer.block1")
        m.release("transformer.block1")                      # a release waits for the load, then frees it
        assert m.state["transformer.block1"] is Residency.RELEASED
        assert materialised_bytes([pipe.transformer.transformer_blocks[1]]) == 0
    finally:
        m.close()


def test_bound_evicts_least_recently_used_unpinned_units(dit):
    pipe, units = dit
    sizes = {u.name: u.nbytes for u in units}
    bound = sizes["transformer.head"] + sizes["transformer.block0"] + sizes["transformer.block1"] // 2
    m = ResidencyManager(units, DiskTier(), max_resident_bytes=bound, prefetch=True)
    m.start()
    try:
        m.ensure("transformer.head")
        m.ensure("transformer.block0")
        m.prefetch("transformer.block1")                           # does not fit: skipped, never forced
        assert m.state["transformer.block1"] is Residency.RELEASED and m.stats()["prefetch_skipped"] == 1
        m.pinned = {"transformer.head", "transformer.block1"}
        m.ensure("transformer.block1")                             # evicts block0 (unpinned, least recent)
        assert m.state["transformer.block0"] is Residency.RELEASED
        assert m.measured_resident_bytes() <= bound and m.stats()["evictions"] == 1
        m.pinned = {"transformer.head", "transformer.block1"}
        with pytest.raises(WorkerFatalError, match="cannot bring in"):
            m.ensure("vae")                                        # everything resident is pinned
        assert m.peak_resident_bytes <= bound
    finally:
        m.close()


def test_failed_load_leaves_the_unit_released(dit):
    pipe, units = dit
    m = ResidencyManager(units, BrokenDiskTier("transformer.block0"), prefetch=True)
    m.start()
    try:
        with pytest.raises(WorkerFatalError, match="loading transformer.block0 failed: OSError"):
            m.ensure("transformer.block0")
        m.prefetch("transformer.block0")
        with pytest.raises(WorkerFatalError, match="OSError"):
            m.ensure("transformer.block0")
        assert m.state["transformer.block0"] is Residency.RELEASED
        assert m.measured_resident_bytes() == m._resident == 0
        m.ensure("transformer.block1")                             # the other units still work
    finally:
        m.close()
