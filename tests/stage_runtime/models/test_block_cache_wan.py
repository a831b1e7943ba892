"""The block cache (stage_runtime/models/block_cache.py) on the Wan family, through the real engine: Wan 2.1, Wan 2.2
A14B (two experts), TI2V-5B and I2V, in request and step mode.

- threshold 0: the video is bitwise the uncached one (the cache runs, and never skips);
- a huge threshold: only the forced steps compute, and on Wan 2.2 the first step on ``transformer_2`` too: a
  request's residual is per expert, so the step that crosses the boundary computes there (it never adds the other
  expert's residual), and the steps after it skip against ``transformer_2``'s own reference;
- one step-mode tick whose rows run on both experts, each request with its own policy, equals each solo run;
- a request-mode wave of two requests (one with two videos) equals each solo run: the rows of each request are
  together, as the step loop lays them out.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_probes import max_diff, run_together, runner_of
from family_checks import Family

from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.models.block_cache import cache_blocks

torch.set_num_threads(1)
ROWS = {"wan": Family("wan", size=16, frames=9), "wan22": Family("wan22", size=16, frames=9),
        "wan-ti2v": Family("wan-ti2v", size=32, frames=9), "wan-i2v": Family("wan-i2v", size=16, frames=9,
                                                                            reference=True)}
STEPS, WARMUP, FINAL = 8, 2, 1        # tiny Wan 2.2 at 8 steps: t = 999, 954, 900 on transformer, then transformer_2
_ENGINES: dict[tuple, DiffusionEngine] = {}


def engine_for(tiny_model, kind: str, mode: str) -> DiffusionEngine:
    if (kind, mode) not in _ENGINES:
        config = load_config({"model": {"path": tiny_model(kind)}, "device": "cpu", "warmup": False,
                              "cache": {"warmup_steps": WARMUP, "final_steps": FINAL},
                              "scheduler": {"execution_mode": mode, "max_num_seqs": 2}})
        _ENGINES[(kind, mode)] = DiffusionEngine(config)        # threadless: step() runs it
    return _ENGINES[(kind, mode)]


@pytest.fixture(scope="module", autouse=True)
def _close_engines():
    yield
    for engine in _ENGINES.values():
        engine.close()
    _ENGINES.clear()


class LastBlocks:
    """Which expert's last block really computed, forward by forward (a pre-hook on its self-attention)."""

    def __init__(self, engine):
        adapter = runner_of(engine).adapter
        self.ran: list[str] = []
        self.handles = [cache_blocks(adapter, part)[-1].attn1.register_forward_pre_hook(
            lambda _m, _a, part=part: self.ran.append(part)) for part in adapter.block_holders()]

    def close(self):
        for handle in self.handles:
            handle.remove()


@pytest.mark.parametrize("mode", ["request", "step"])
@pytest.mark.parametrize("kind", list(ROWS))
def test_threshold_zero_is_bitwise_no_cache_and_a_huge_one_computes_only_the_forced_steps(tiny_model, kind, mode):
    engine, row = engine_for(tiny_model, kind, mode), ROWS[kind]
    plain = run_together(engine, [row.request("plain", "a red fox", STEPS, 3, guidance_scale=5.0)])["plain"]
    zero = run_together(engine, [row.request("zero", "a red fox", STEPS, 3, guidance_scale=5.0,
                                             cache={"threshold": 0.0})])["zero"]
    assert np.array_equal(zero.images, plain.images) and zero.images.shape == (1, 9, row.size, row.size, 3)
    assert "steps_skipped" not in plain.metrics
    assert (zero.metrics["steps_computed"], zero.metrics["steps_skipped"]) == (STEPS, 0)

    last = LastBlocks(engine)
    try:
        huge = run_together(engine, [row.request("huge", "a red fox", STEPS, 3, guidance_scale=5.0,
                                                 cache={"threshold": 10.0})])["huge"]
    finally:
        last.close()
    if kind == "wan22":            # warmup on transformer; the boundary step and the final one on transformer_2
        assert last.ran == ["transformer"] * WARMUP + ["transformer_2"] * (1 + FINAL)
        computed = WARMUP + 1 + FINAL
    else:
        assert last.ran == ["transformer"] * (WARMUP + FINAL)
        computed = WARMUP + FINAL
    assert (huge.metrics["steps_computed"], huge.metrics["steps_skipped"]) == (computed, STEPS - computed)
    assert max_diff(huge.images, plain.images) > 0           # the cache changed something
    assert runner_of(engine).num_cache_states() == 0


def test_a_wan22_tick_with_rows_on_both_experts_equals_each_solo_run(tiny_model):
    """"long" (8 steps, huge threshold) is on transformer for 3 ticks while "short" (2 steps, threshold 0) is on
    transformer_2 from its second: tick 1 runs one request on each expert, each under its own cache."""
    engine, row = engine_for(tiny_model, "wan22", "step"), ROWS["wan22"]
    batch = [row.request("long", "a red fox", STEPS, 1, cache={"threshold": 10.0}),
             row.request("short", "a blue car", 2, 2, num_outputs=2, cache={"threshold": 0.0})]
    experts = runner_of(engine).adapter.experts
    calls = {"step": 0, "transformer": 0, "transformer_2": 0}
    hooks = [module.register_forward_pre_hook(lambda _m, _a, k=name: calls.__setitem__(k, calls[k] + 1))
             for name, module in (("step", experts), ("transformer", experts.transformer),
                                  ("transformer_2", experts.transformer_2))]
    try:
        together = run_together(engine, batch)
    finally:
        for hook in hooks:
            hook.remove()
    assert calls["step"] == STEPS and calls["transformer"] + calls["transformer_2"] > STEPS     # a shared tick
    assert together["long"].metrics["steps_skipped"] == STEPS - (WARMUP + 1 + FINAL)
    assert together["short"].metrics["steps_skipped"] == 0
    for r in batch:
        solo = run_together(engine, [r])[r.request_id]
        assert max_diff(together[r.request_id].images, solo.images) <= 2, r.request_id
        assert solo.metrics["steps_skipped"] == together[r.request_id].metrics["steps_skipped"]


@pytest.mark.parametrize("kind", ["wan", "wan22"])
def test_a_request_mode_wave_of_two_policies_equals_each_solo_run(tiny_model, kind):
    engine, row = engine_for(tiny_model, kind, "request"), ROWS[kind]
    batch = [row.request("huge", "a red fox", STEPS, 1, num_outputs=2, cache={"threshold": 10.0}),
             row.request("off", "a blue car", STEPS, 2, cache="off")]
    calls = [0]
    handle = runner_of(engine).adapter.denoiser.register_forward_pre_hook(
        lambda _m, _a: calls.__setitem__(0, calls[0] + 1))
    try:
        together = run_together(engine, batch)
    finally:
        handle.remove()
    assert calls[0] == STEPS                                              # one wave
    assert together["huge"].metrics["steps_skipped"] > 0 and "steps_skipped" not in together["off"].metrics
    for r in batch:
        solo = run_together(engine, [r])[r.request_id]
        assert max_diff(together[r.request_id].images, solo.images) <= 1, r.request_id
        assert solo.metrics.get("steps_skipped") == together[r.request_id].metrics.get("steps_skipped")
