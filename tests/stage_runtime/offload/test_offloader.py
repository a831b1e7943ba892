"""The offloader inside the real model runner on the tiny SD and DiT pipelines: images equal the no-offload
images bitwise in every mode (request and step mode), no module ever runs before its unit is resident with
its original bytes, the configured bound holds (measured on the storages), 100 requests leave nothing
behind, and close releases everything."""

from __future__ import annotations

import threading

import pytest
import torch

from offload_probes import (bitwise_equal, fds_opened_since, make_runner, materialised_bytes, max_diff,
                            module_components, offload_mappings, open_fds, req, rss_bytes, run_request, run_steps,
                            snapshot)
from stage_runtime.errors import ConfigError
from stage_runtime.offload.manager import Residency
from stage_runtime.offload.offloader import Offloader
from stage_runtime.offload.tiers import HostTier
from tiers_for_tests import SlowDiskTier

MODES = {
    "model": {"mode": "model"},
    "layerwise": {"mode": "layerwise"},
    "layerwise-sync": {"mode": "layerwise", "prefetch": False, "resident_layers": 1},
}


@pytest.fixture(scope="module", params=["sd", "dit"])
def model(request, tiny_sd_path, tiny_dit_path):
    path, prompt = {"sd": (tiny_sd_path, "a red fox"), "dit": (tiny_dit_path, "207")}[request.param]
    runner = make_runner(path)
    reference = {"request": run_request(runner, req("ref", prompt, steps=3, seed=5)),
                 "step": run_steps(runner, req("ref-step", prompt, steps=3, seed=5))}
    runner.close()
    return path, prompt, reference


@pytest.mark.parametrize("mode", list(MODES))
def test_images_equal_the_no_offload_images(model, mode):
    path, prompt, reference = model
    runner = make_runner(path, MODES[mode])
    try:
        assert max_diff(run_request(runner, req("a", prompt, steps=3, seed=5)), reference["request"]) == 0
        assert runner.offloader.manager.measured_resident_bytes() == 0          # released when the call ended
        assert max_diff(run_steps(runner, req("b", prompt, steps=3, seed=5)), reference["step"]) == 0
        assert runner.offloader.manager.measured_resident_bytes() == 0          # released with the last state
        stats = runner.offload_stats()
        assert stats["mode"] == MODES[mode]["mode"] and stats["loads"] > 0
        assert stats["resident_bytes"] == {"cpu": 0, "disk": stats["managed_bytes"]}
    finally:
        runner.close()


def test_offload_off_builds_nothing(tiny_sd_path):
    runner = make_runner(tiny_sd_path)
    try:
        assert runner.offloader is None and runner.offload_stats() == {"mode": "none"}
        hooks = [m for c in module_components(runner).values() for m in c.modules() if m._forward_pre_hooks]
        assert hooks == []
    finally:
        runner.close()


def install_readiness_check(runner, reference: dict) -> list[int]:
    """After the offloader's hooks: every module call sees its unit RESIDENT and its own weights bitwise intact."""
    offloader, calls = runner.offloader, [0]
    for unit in offloader.units:
        for module in unit.modules:
            own = [(n, t) for n, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]]

            def check(mod, args, unit=unit, own=own):
                calls[0] += 1
                assert offloader.manager.state[unit.name] is Residency.RESIDENT, unit.name
                for name, t in own:
                    assert bitwise_equal(t, reference[id(t)]), f"{unit.name}: {name}"
            module.register_forward_pre_hook(check)
    return calls


@pytest.mark.parametrize("mode", ["model", "layerwise"])
def test_no_module_runs_before_its_unit_is_ready(tiny_sd_path, mode):
    """With a slow disk, the prefetch is still in flight when a block is reached: the hook must wait."""
    runner = make_runner(tiny_sd_path)
    pipe = runner.adapter.pipe
    tensors = {id(t): t.detach().clone() for c in module_components(runner).values()
               for t in [*c.parameters(), *c.buffers()]}
    runner.offloader = Offloader(runner.config.offload.model_copy(update={"mode": mode}), pipe,
                                 runner.adapter.denoiser, runner.device, tier=SlowDiskTier(delay_s=0.01))
    calls = install_readiness_check(runner, tensors)
    try:
        run_request(runner, req("a", steps=2))
        run_steps(runner, req("b", steps=2))
        assert calls[0] > 100
        if mode == "layerwise":
            assert runner.offload_stats()["prefetch_waits"] > 0          # the race really happened
    finally:
        runner.close()


def test_layerwise_peak_resident_bytes_stay_under_the_bound(tiny_sd_path):
    probe = make_runner(tiny_sd_path, {"mode": "layerwise", "components": ["unet"]})
    sizes = {u.name: u.nbytes for u in probe.offloader.units}
    probe.close()
    blocks = sorted(v for k, v in sizes.items() if ".block" in k)
    bound = sizes["unet.head"] + blocks[-1] + blocks[-2]
    # A window of 3 blocks would exceed it (the 3 largest are adjacent: down1, mid, up0): the bound must hold.
    assert sizes["unet.head"] + sum(blocks[-3:]) > bound
    runner = make_runner(tiny_sd_path, {"mode": "layerwise", "components": ["unet"], "resident_layers": 3,
                                        "max_host_bytes": bound})
    unet = runner.adapter.pipe.unet
    samples: list[int] = []

    def sample(*_):
        samples.append(materialised_bytes([unet]))
    for module in unet.modules():
        module.register_forward_pre_hook(sample)
        module.register_forward_hook(sample)
    try:
        run_request(runner, req("a", steps=3))
        run_steps(runner, req("b", steps=3))
        assert len(samples) > 100
        assert max(samples) <= bound
        assert max(samples) >= sizes["unet.head"] + min(blocks)          # it did run with weights in
        stats = runner.offload_stats()
        assert stats["peak_resident_bytes"] <= bound and stats["max_resident_bytes"] == bound
    finally:
        runner.close()


def test_a_bound_below_the_working_set_is_a_config_error(tiny_sd_path):
    with pytest.raises(ConfigError, match=r"offload.max_host_bytes=1000 is below the \d+ bytes that must be "
                                          r"resident at once \(unet\); raise it or use mode=layerwise"):
        make_runner(tiny_sd_path, {"mode": "model", "max_host_bytes": 1000})


def test_100_requests_leave_no_growth(tiny_sd_path):
    runner = make_runner(tiny_sd_path, {"mode": "layerwise"})
    try:
        components = module_components(runner)
        for unit in runner.offloader.units:                              # bring all in to take the snapshot
            runner.offloader.manager.ensure(unit.name)
        before = {n: snapshot(c) for n, c in components.items()}
        runner.offloader.release_all()
        params = {n: dict(c.named_parameters()) for n, c in components.items()}
        for i in range(10):                                              # warm up allocator and caches
            run_request(runner, req(f"w{i}", steps=1, seed=i))
        fds, maps, rss = open_fds(), offload_mappings(), rss_bytes()
        peak = runner.offload_stats()["peak_resident_bytes"]
        for i in range(100):
            run = run_request if i % 2 else run_steps
            run(runner, req(f"r{i}", steps=1, seed=i))
            assert runner.offloader.manager.measured_resident_bytes() == 0
        stats = runner.offload_stats()
        assert stats["peak_resident_bytes"] == peak and stats["units_resident"] == 0
        assert fds_opened_since(fds) == {} and offload_mappings() == maps
        assert rss_bytes() - rss < 32 * 2**20, f"RSS grew by {(rss_bytes() - rss) / 2**20:.1f} MiB"
        for unit in runner.offloader.units:                              # after ~110 round trips of every unit
            runner.offloader.manager.ensure(unit.name)
        for name, component in components.items():
            for qual, t in [*component.named_parameters(), *component.named_buffers()]:
                assert bitwise_equal(t, before[name][qual]), f"{name}.{qual}"
            assert all(t is params[name][q] for q, t in component.named_parameters())
    finally:
        runner.close()


def test_close_releases_everything(tiny_sd_path):
    fds = open_fds()
    runner = make_runner(tiny_sd_path, {"mode": "layerwise"})
    modules = list(module_components(runner).values())
    run_steps(runner, req("a", steps=2))
    assert offload_mappings() != []
    offloader = runner.offloader
    runner.close()
    assert materialised_bytes(modules) == 0
    assert offload_mappings() == [] and fds_opened_since(fds) == {}
    assert [m for c in modules for m in c.modules() if m._forward_pre_hooks] == []
    assert not [t for t in threading.enumerate() if t.name.startswith("offload-prefetch")]
    assert offloader.manager.closed
    conv = next(m for c in modules for m in c.modules() if isinstance(m, torch.nn.Conv2d))
    with pytest.raises(RuntimeError):                  # a released module fails loudly, never reads freed memory
        conv(torch.zeros(1, conv.in_channels, 8, 8))
    runner.close()                                                       # idempotent


def test_host_tier_policy_on_cpu(tiny_dit_path):
    """The cuda<->cpu tier's code (host masters, release without copy) run on CPU: same images, bounded copies."""
    runner = make_runner(tiny_dit_path)
    reference = run_request(runner, req("ref", "207", steps=3, seed=5))
    config = runner.config.offload.model_copy(update={"mode": "layerwise"})
    total = sum(materialised_bytes([c]) for c in module_components(runner).values())
    with pytest.raises(ConfigError, match=rf"offload.max_host_bytes=1000 is below the {total} bytes .*\(the host "
                                          r"copies of every managed weight\)"):
        Offloader(config.model_copy(update={"max_host_bytes": 1000}), runner.adapter.pipe,
                  runner.adapter.denoiser, runner.device, tier=HostTier(runner.device))
    runner.offloader = Offloader(config.model_copy(update={"max_host_bytes": total}), runner.adapter.pipe,
                                 runner.adapter.denoiser, runner.device, tier=HostTier(runner.device))
    try:
        assert max_diff(run_request(runner, req("a", "207", steps=3, seed=5)), reference) == 0
        stats = runner.offload_stats()
        assert stats["tier"] == "cpu<->cpu" and stats["host_held_bytes"] == total
    finally:
        runner.close()


def test_an_offload_dir_that_cannot_be_used_is_named(tiny_dit_path, tmp_path):
    with pytest.raises(ConfigError, match=r"offload.dir='.*missing': cannot create the offload folder there"):
        make_runner(tiny_dit_path, {"mode": "model", "dir": str(tmp_path / "missing")})
