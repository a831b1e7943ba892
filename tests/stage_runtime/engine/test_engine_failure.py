"""Fail closed: an executor latched dead mid-request ends every stream with EngineDeadError."""

from __future__ import annotations

import threading

import pytest

from support.waiting import wait_until

from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.errors import EngineDeadError
from stage_runtime.request import DiffusionRequest, SamplingParams


def req(rid: str, steps: int = 3) -> DiffusionRequest:
    return DiffusionRequest(rid, "a cat", SamplingParams(num_inference_steps=steps, seed=1))


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "diffusion-engine"]


@pytest.fixture
def engine(tiny_sd_path):
    config = load_config({"model": {"path": tiny_sd_path}, "device": "cpu", "warmup": False,
                          "executor": "uni", "scheduler": {"max_num_seqs": 1}})
    eng = DiffusionEngine.make_engine(config)
    yield eng
    eng.close()


def test_executor_death_fails_running_and_waiting_streams(engine):
    assert engine.state == "ready"
    running = engine.add_request(req("long", steps=500))
    waiting = engine.add_request(req("queued"))
    wait_until(lambda: any(r["step"] >= 1 for r in engine.requests_snapshot()))

    engine.executor.mark_dead("rank 0 died")

    for stream in (running, waiting):
        with pytest.raises(EngineDeadError, match="rank 0 died"):
            stream.result(timeout=10)
    assert engine.state == "dead"
    assert engine.dead_reason == "rank 0 died"
    with pytest.raises(EngineDeadError, match="rank 0 died"):
        engine.add_request(req("late"))
    with pytest.raises(EngineDeadError, match="rank 0 died"):
        engine.collective_rpc("ping")
    assert engine.abort("long") == []
    # The busy loop stops on its own (the running pipeline call is interrupted at its next step).
    wait_until(lambda: not engine_threads(), timeout=10)
    assert engine.executor.worker.model_runner.num_request_states() == 0

    engine.close()
    engine.close()                                           # idempotent
    assert engine.state == "dead"                            # closing does not hide why it died
    assert engine.executor.worker is None
    assert not engine_threads()
    with pytest.raises(EngineDeadError):
        engine.add_request(req("after-close"))


def test_executor_death_while_idle(engine):
    assert engine.generate("a cat", num_inference_steps=2, seed=1).ok
    engine.executor.mark_dead("rank 0 died")
    assert engine.state == "dead"
    with pytest.raises(EngineDeadError, match="rank 0 died"):
        engine.add_request(req("late"))
    wait_until(lambda: not engine_threads(), timeout=10)
    engine.close()
    engine.close()
    assert not engine_threads()

