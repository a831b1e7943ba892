"""The per-request block cache (stage_runtime/models/block_cache.py) through the real engine, on every
transformer family, in request and step mode.

- threshold 0: the image is bitwise the uncached one (the cache runs, and never skips);
- a huge threshold: the rest of the blocks run exactly on the forced steps (counted by a hook inside the
  last block), and the image differs from the uncached one (the cache does something);
- one step-mode tick of a cached request, a ``cache: "off"`` request and a request with another threshold:
  each equals its solo run (<= 2 uint8), sharing every forward;
- terminal paths (abort, error, close) drop the request's cache state.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
from engine_probes import max_diff, run_together, runner_of

from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.errors import ConfigError, InvalidRequestError, RequestAbortedError, RequestFailedError
from stage_runtime.models.block_cache import BlockCachePolicy, BlockCacheState, cache_blocks
from stage_runtime.request import DiffusionRequest, SamplingParams

FAMILIES = {"dit": ("tiny_dit_path", {"guidance_scale": 4.0}),
            "sd3": ("tiny_sd3_path", {"height": 64, "width": 64, "guidance_scale": 5.0}),
            "flux": ("tiny_flux_path", {"height": 64, "width": 64}),
            "qwen-image": ("tiny_qwen_image_path", {"height": 64, "width": 64, "guidance_scale": 4.0}),
            "zimage": ("tiny_zimage_path", {"height": 64, "width": 64, "guidance_scale": 3.0}),
            "flux2": ("tiny_flux2_path", {"height": 64, "width": 64}),
            "flux2-klein": ("tiny_flux2_klein_path", {"height": 64, "width": 64, "guidance_scale": 4.0})}
STEPS, WARMUP, FINAL = 8, 2, 1
_ENGINES: dict[tuple[str, str], DiffusionEngine] = {}


def engine_for(request, family: str, mode: str, **cache) -> DiffusionEngine:
    key = (family, mode, tuple(sorted(cache.items())))
    if key not in _ENGINES:
        path = request.getfixturevalue(FAMILIES[family][0])
        config = load_config({"model": {"path": path}, "device": "cpu", "warmup": False,
                              "cache": {"warmup_steps": WARMUP, "final_steps": FINAL, **cache},
                              "scheduler": {"execution_mode": mode, "max_num_seqs": 4}})
        _ENGINES[key] = DiffusionEngine.make_engine(config)
    return _ENGINES[key]


@pytest.fixture(scope="module", autouse=True)
def _close_engines():
    yield
    for engine in _ENGINES.values():
        engine.close()
    _ENGINES.clear()


def req(rid: str, family: str, seed: int = 3, steps: int = STEPS, **kw) -> DiffusionRequest:
    return DiffusionRequest(rid, "a cat", SamplingParams(num_inference_steps=steps, seed=seed,
                                                         **{**FAMILIES[family][1], **kw}))


class RestOfBlocks:
    """Counts the forwards (and rows) the last block really computes: a pre-hook on its attention."""

    def __init__(self, engine):
        last = cache_blocks(runner_of(engine).adapter)[-1]
        attn = getattr(last, "attn", None) or getattr(last, "attention", None) or last.attn1     # Z-Image: attention
        self.calls = self.rows = 0
        self.handle = attn.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, _module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        self.calls += 1
        self.rows += hidden.shape[0]

    def close(self):
        self.handle.remove()


@pytest.mark.parametrize("mode", ["request", "step"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_threshold_zero_is_bitwise_no_cache_and_a_huge_one_computes_only_the_forced_steps(request, family, mode):
    engine = engine_for(request, family, mode)
    plain = engine.add_request(req("plain", family)).result(timeout=120)
    zero = engine.add_request(req("zero", family, cache={"threshold": 0.0})).result(timeout=120)
    assert np.array_equal(zero.images, plain.images)
    assert "steps_skipped" not in plain.metrics
    assert (zero.metrics["steps_computed"], zero.metrics["steps_skipped"]) == (STEPS, 0)

    counter = RestOfBlocks(engine)
    try:
        huge = engine.add_request(req("huge", family, cache={"threshold": 10.0})).result(timeout=120)
    finally:
        counter.close()
    forced = WARMUP + FINAL
    assert counter.calls == forced
    assert (huge.metrics["steps_computed"], huge.metrics["steps_skipped"]) == (forced, STEPS - forced)
    assert max_diff(huge.images, plain.images) > 0           # the cache changed something
    assert runner_of(engine).num_cache_states() == 0


@pytest.mark.parametrize("family", ["dit", "flux", "flux2-klein"])   # FLUX.2: a joint [text ‖ image] last block
def test_one_tick_mixes_a_cached_an_off_and_another_threshold_request_each_equal_to_its_solo_run(
        request, family):
    path = request.getfixturevalue(FAMILIES[family][0])
    config = load_config({"model": {"path": path}, "device": "cpu", "warmup": False,
                          "cache": {"mode": "block", "threshold": 0.3, "warmup_steps": 2, "final_steps": 1},
                          "scheduler": {"execution_mode": "step", "max_num_seqs": 3}})
    engine = DiffusionEngine(config)                    # threadless: step() runs it, so all three share ticks
    try:
        batch = [req("cached", family, seed=1), req("off", family, seed=2, cache="off"),
                 req("other", family, seed=3, cache={"threshold": 10.0})]
        calls = [0]
        handle = runner_of(engine).adapter.denoiser.register_forward_pre_hook(
            lambda _m, _a: calls.__setitem__(0, calls[0] + 1))
        together = run_together(engine, batch)
        handle.remove()
        assert calls[0] == STEPS                         # one fused forward per tick for all three
        assert "steps_skipped" not in together["off"].metrics
        assert together["other"].metrics["steps_skipped"] == STEPS - 3
        for r in batch:
            solo = run_together(engine, [r])[r.request_id]
            assert max_diff(together[r.request_id].images, solo.images) <= 2, r.request_id
            assert solo.metrics.get("steps_skipped") == together[r.request_id].metrics.get("steps_skipped")
    finally:
        engine.close()


# CFG halves stacked per wave / true CFG per request / FLUX.2 Klein's CFG halves per request (its own step loop)
@pytest.mark.parametrize("family", ["dit", "qwen-image", "flux2-klein"])
def test_one_request_mode_wave_of_mixed_policies_and_two_images_each_equals_its_solo_runs(request, family):
    path = request.getfixturevalue(FAMILIES[family][0])
    config = load_config({"model": {"path": path}, "device": "cpu", "warmup": False,
                          "scheduler": {"execution_mode": "request", "max_num_seqs": 3}})
    engine = DiffusionEngine(config)
    try:
        batch = [req("huge", family, seed=1, num_outputs=2, cache={"threshold": 10.0}),
                 req("off", family, seed=2, cache="off"), req("mid", family, seed=3, num_outputs=2,
                                                              cache={"threshold": 0.3})]
        calls = [0]
        handle = runner_of(engine).adapter.denoiser.register_forward_pre_hook(
            lambda _m, _a: calls.__setitem__(0, calls[0] + 1))
        together = run_together(engine, batch)
        handle.remove()
        assert calls[0] == STEPS                                          # one fused pipeline call
        assert together["huge"].metrics["steps_skipped"] == STEPS - 2
        for r in batch:
            solo = run_together(engine, [r])[r.request_id]
            assert max_diff(together[r.request_id].images, solo.images) <= 2, r.request_id
            assert solo.metrics.get("steps_skipped") == together[r.request_id].metrics.get("steps_skipped")
    finally:
        engine.close()


def test_parallel_topologies_and_layerwise_offload_refuse_the_block_cache(tiny_dit_path):
    from stage_runtime.models.block_cache import block_cache_refusal
    from stage_runtime.models.families.dit import DiTAdapter

    adapter = DiTAdapter.load(tiny_dit_path, torch_cpu())
    base = {"model": {"path": tiny_dit_path}}
    assert block_cache_refusal(adapter, load_config(base)) is None
    for extra, named in (({"parallel": {"cfg_parallel_size": 2}}, "cfg_parallel_size=2"),
                         ({"parallel": {"ulysses_degree": 2}}, "ulysses_degree=2"),
                         ({"offload": {"mode": "layerwise"}}, "offload.mode=layerwise")):
        assert named in block_cache_refusal(adapter, load_config({**base, **extra}))


def torch_cpu():
    import torch

    return torch.device("cpu")


def test_terminal_paths_drop_the_cache_state(tiny_dit_path):
    config = load_config({"model": {"path": tiny_dit_path, "adapter": "adapters_for_tests:StepFaultDiTAdapter"},
                          "device": "cpu", "warmup": False, "cache": {"mode": "block", "threshold": 10.0},
                          "scheduler": {"execution_mode": "step", "max_num_seqs": 3}})
    engine = DiffusionEngine(config)
    runner = runner_of(engine)
    try:
        aborted = engine.add_request(req("aborted", "dit", steps=20))
        failing = engine.add_request(DiffusionRequest("failing", "late-boom", SamplingParams(num_inference_steps=20,
                                                                                               seed=1)))
        closed = engine.add_request(req("closed", "dit", steps=20))
        for _ in range(2):
            engine.step()
        refs = {rid: weakref.ref(runner.step_states[rid].cache) for rid in ("aborted", "failing", "closed")}
        assert runner.num_cache_states() == 3
        engine.abort("aborted")
        for _ in range(2):
            engine.step()                                # the abort lands; "failing" fails in its third step
        with pytest.raises(RequestAbortedError):
            aborted.result(timeout=1)
        with pytest.raises(RequestFailedError):
            failing.result(timeout=1)
        gc.collect()
        assert refs["aborted"]() is None and refs["failing"]() is None
        assert refs["closed"]() is not None and runner.num_cache_states() == 1
    finally:
        engine.close()
    gc.collect()
    assert refs["closed"]() is None and runner.step_states == {}
    assert closed.finished


@pytest.mark.parametrize("fixture, pipeline", [("tiny_sd_path", "StableDiffusionPipeline"),        # a UNet family
                                               ("tiny_pag_path", "StableDiffusionPAGPipeline")])  # generic adapter
def test_unsupported_families_refuse_the_block_cache_at_startup_and_per_request(request, fixture, pipeline):
    config = {"model": {"path": request.getfixturevalue(fixture)}, "device": "cpu", "warmup": False}
    with pytest.raises(ConfigError, match=f"cache.mode='block': {pipeline} has no block cache"):
        DiffusionEngine(load_config({**config, "cache": {"mode": "block"}}))
    engine = DiffusionEngine(load_config(config))
    try:
        with pytest.raises(InvalidRequestError) as err:
            engine.add_request(DiffusionRequest("r", "a cat", SamplingParams(cache={"threshold": 0.1})))
        assert err.value.field == "cache"
        off = engine.add_request(DiffusionRequest("off", "a cat", SamplingParams(cache="off", num_inference_steps=2)))
        while not off.finished:
            engine.step()
        assert off.result(timeout=1).ok
    finally:
        engine.close()


def test_the_decision_forces_warmup_and_final_steps_and_limits_consecutive_skips():
    import torch

    state = BlockCacheState(BlockCachePolicy(threshold=1.0, warmup_steps=2, final_steps=1, max_consecutive_skips=2),
                            num_steps=8)
    signal = {0: torch.ones(1, 4), 1: torch.ones(1, 4)}
    decisions = []
    for _ in range(8):
        skip = state.decide(signal)
        if not skip:
            state.residual = {0: torch.zeros(1, 4), 1: torch.zeros(1, 4)}
        decisions.append(skip)
    #           warmup        skip  skip  forced(limit)  skip  skip  final
    assert decisions == [False, False, True, True, False, True, True, False]
    assert state.counts() == {"steps_computed": 4, "steps_skipped": 4}


@pytest.mark.parametrize("offload", [0, 1 << 30], ids=["kept-in-place", "offloaded-to-host"])
def test_a_preempted_cached_request_resumes_to_the_same_image_and_skips(tiny_dit_path, offload):
    config = load_config({"model": {"path": tiny_dit_path}, "device": "cpu", "warmup": False,
                          "cache": {"mode": "block", "threshold": 0.3},
                          "scheduler": {"execution_mode": "step", "max_num_seqs": 1, "scheduling_policy": "priority",
                                        "preempted_offload_max_bytes": offload}})
    engine = DiffusionEngine(config)
    try:
        alone = run_together(engine, [req("alone", "dit", seed=7, steps=12)])["alone"]
        long = engine.add_request(req("long", "dit", seed=7, steps=12))
        for _ in range(5):
            engine.step()
        urgent = engine.add_request(req("urgent", "dit", seed=8, steps=3, priority=5))
        while not (long.finished and urgent.finished):
            engine.step()
        assert engine.scheduler.get_request_state("long") is None
        resumed = long.result(timeout=1)
        assert np.array_equal(resumed.images, alone.images)
        assert resumed.metrics["preemptions"] == 1
        assert resumed.metrics["steps_skipped"] == alone.metrics["steps_skipped"] > 0
        engine.step()
        assert runner_of(engine).num_cache_states() == 0 and runner_of(engine).parked == {}
    finally:
        engine.close()
