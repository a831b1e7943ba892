"""The engine's observation surface used by the stage process: ``stats()`` and execute observers."""

from __future__ import annotations

import pytest

from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine


@pytest.mark.parametrize("mode", ["request", "step"])
def test_stats_and_execute_observer(tiny_sd_path, mode):
    config = load_config({"model": {"path": tiny_sd_path}, "device": "cpu", "warmup": False,
                          "scheduler": {"execution_mode": mode, "max_num_seqs": 3, "max_waiting": 5}})
    engine = DiffusionEngine.make_engine(config)
    seen: list[tuple[int, float, int]] = []
    engine.observers.add(lambda batch, seconds, steps: seen.append((batch, seconds, steps)))
    engine.observers.add(lambda *_: 1 / 0)                  # a broken observer is logged, not fatal
    try:
        assert engine.stats() == {"waiting": 0, "running": 0, "capacity": 3, "finished_total": 0,
                                  "aborted_total": 0, "failed_total": 0}
        assert engine.generate("a cat", num_inference_steps=3, seed=1).ok
        assert engine.stats()["finished_total"] == 1
    finally:
        engine.close()
    if mode == "request":
        assert [(b, s) for b, _, s in seen] == [(1, 3)]            # one wave of three steps
    else:
        assert [(b, s) for b, _, s in seen] == [(1, 1)] * 3        # three ticks of one step
    assert all(seconds > 0 for _, seconds, _ in seen)
