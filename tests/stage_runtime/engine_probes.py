"""Observation helpers shared by the engine tests (they watch the real engine; they replace nothing)."""

from __future__ import annotations

import numpy as np
from support.waiting import wait_until

__all__ = ["assert_no_state", "count_at_delivery", "count_denoiser_calls", "max_diff", "runner_of", "wait_until"]


def runner_of(engine):
    return engine.executor.worker.model_runner


def assert_no_state(engine) -> None:
    """Engine, scheduler and runner hold nothing for finished requests.

    An aborted request is delivered at the next step; the runner's call unwinds right after it.
    """
    wait_until(lambda: runner_of(engine).num_request_states() == 0, timeout=5)
    assert engine.num_request_states() == 0
    assert engine.scheduler.num_states == 0
    assert runner_of(engine).step_states == {}


def count_denoiser_calls(engine) -> list[int]:
    calls = [0]
    runner_of(engine).adapter.denoiser.register_forward_pre_hook(lambda m, a: calls.__setitem__(0, calls[0] + 1))
    return calls


def count_at_delivery(stream, calls: list[int]) -> list[int]:
    """Instrument one stream: the denoiser call count at the moment its final output is delivered."""
    seen: list[int] = []
    put = stream.put

    def recording_put(item):
        if item.finished:
            seen.append(calls[0])
        put(item)

    stream.put = recording_put
    return seen


def max_diff(a: np.ndarray, b: np.ndarray) -> int:
    assert a.shape == b.shape
    return int(np.abs(a.astype(int) - b.astype(int)).max())


def threadless(path: str, mode: str = "step", **scheduler):
    """An engine without its busy-loop thread: each ``engine.step()`` is one tick (step mode) or one wave, so "the
    next step" is an exact tick count, not a wall-clock guess. One running request at a time by default."""
    from stage_runtime.config import load_config
    from stage_runtime.engine import DiffusionEngine

    config = load_config({"model": {"path": path}, "device": "cpu", "warmup": False,
                          "scheduler": {"execution_mode": mode, "max_num_seqs": 1, **scheduler}})
    return DiffusionEngine(config)


def assert_nothing_left(engine) -> None:
    """After an empty tick (it retires what the last one ended): no request state in the engine, the
    scheduler or the runner, nothing parked."""
    engine.step()
    runner = runner_of(engine)
    assert engine.num_request_states() == 0 and engine.scheduler.num_states == 0
    assert runner.step_states == {} and runner.parked == {}
    assert runner.num_request_states() == 0


def progress_of(items) -> list[tuple[str, int]]:
    """A stream's progress items as (phase, step) in order (the final item left out)."""
    return [(i.phase, i.step_index) for i in items if not i.finished]


def phased(steps: int, first: int = 1) -> list[tuple[str, int]]:
    """What a streamed request of ``steps`` steps reports, in order: it enters its encode phase, each denoising step
    (from ``first``) but the last, then its decode phase."""
    return [("encode", 0), *(("denoise", k) for k in range(first, steps)), ("decode", steps)]


def run_together(engine, requests) -> dict:
    """Submit ``requests`` to a threadless engine at once and step it until every one has ended: {id: final}."""
    streams = {r.request_id: engine.add_request(r) for r in requests}
    while not all(s.finished for s in streams.values()):
        assert engine.step()
    return {rid: s.result(timeout=1) for rid, s in streams.items()}
