"""``DiffusionEngine.step()`` driven by the test, without the busy-loop thread: schedule → execute → update.

Each call is one iteration of the loop: one request-mode wave, or one step-mode tick (every running
request advances one denoising step). Nothing runs between calls, so the test sees every state.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_probes import phased, progress_of

from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.errors import InvalidRequestError
from stage_runtime.request import DiffusionRequest, RequestStatus, SamplingParams


def threadless(path: str, mode: str, **scheduler) -> DiffusionEngine:
    config = load_config({"model": {"path": path}, "device": "cpu", "warmup": False,
                          "scheduler": {"execution_mode": mode, **scheduler}})
    return DiffusionEngine(config)          # constructed, never started: only step() runs it


def bare(engine: DiffusionEngine, prompt: str, steps: int, seed: int) -> np.ndarray:
    pipe = engine.executor.worker.model_runner.adapter.pipe
    with torch.inference_mode():
        images = pipe(prompt, num_inference_steps=steps, generator=torch.Generator("cpu").manual_seed(seed),
                      output_type="np").images
    return (images * 255).round().clip(0, 255).astype(np.uint8)


def req(rid: str, steps: int, seed: int = 1, **kw) -> DiffusionRequest:
    return DiffusionRequest(rid, "a cat", SamplingParams(num_inference_steps=steps, seed=seed, **kw))


@pytest.fixture(scope="module")
def request_engine(tiny_sd_path):
    engine = threadless(tiny_sd_path, "request", max_num_seqs=2)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def step_engine(tiny_sd_path):
    engine = threadless(tiny_sd_path, "step", max_num_seqs=2)
    yield engine
    engine.close()


def test_one_step_runs_one_request_mode_wave_of_both_requests(request_engine):
    engine = request_engine
    a, b = engine.add_request(req("a", 2, seed=1)), engine.add_request(req("b", 2, seed=2))
    assert engine.stats()["waiting"] == 2 and not a.finished
    assert engine.step() is True                        # one fused wave: both requests end in it
    out_a, out_b = a.result(timeout=0), b.result(timeout=0)
    assert np.abs(out_a.images.astype(int) - bare(engine, "a cat", 2, 1)).max() <= 1
    assert np.abs(out_b.images.astype(int) - bare(engine, "a cat", 2, 2)).max() <= 1
    assert engine.num_request_states() == 0 and engine.counters["finished_total"] == 2


def test_a_step_with_nothing_scheduled_calls_no_worker(request_engine):
    runner = request_engine.executor.worker.model_runner
    calls = []
    handle = runner.adapter.denoiser.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        assert request_engine.step() is True and calls == []
    finally:
        handle.remove()


def test_each_step_advances_every_running_request_one_denoising_step(step_engine):
    engine = step_engine
    long, short = engine.add_request(req("long", 3)), engine.add_request(req("short", 2, stream=True))
    for tick in (1, 2, 3):
        assert engine.step() is True
        state = engine.scheduler.get_request_state("long")
        if tick < 3:
            assert state.status == RequestStatus.RUNNING and state.step_index == tick
            assert not long.finished
    items = []
    while not items or not items[-1].finished:
        items.append(short.get(timeout=0))
    assert progress_of(items) == phased(2) and items[-1].step_index == 2 and items[-1].images is not None
    images = long.result(timeout=0).images
    assert images.shape == (1, 64, 64, 3) and np.abs(images.astype(int) - bare(engine, "a cat", 3, 1)).max() <= 2
    assert engine.step() is True                        # idle: retires nothing, runs nothing
    assert engine.num_request_states() == 0 and engine.executor.worker.model_runner.step_states == {}


def test_the_requests_snapshot_says_each_requests_phase(step_engine):
    engine = step_engine
    stream = engine.add_request(req("phased", 3, stream=True))
    assert [(r["state"], r["phase"]) for r in engine.requests_snapshot()] == [("waiting", None)]
    engine.step()                                       # encoded, then its first step
    assert [(r["phase"], r["step"]) for r in engine.requests_snapshot()] == [("denoise", 1)]
    assert [(i.phase, i.step_index) for i in (stream.get(timeout=0), stream.get(timeout=0))] == [
        ("encode", 0), ("denoise", 1)]
    engine.step(), engine.step()
    assert engine.requests_snapshot() == [] and progress_of(list(stream)) == [("denoise", 2), ("decode", 3)]


def test_an_abort_between_steps_is_applied_by_the_next_step_and_retires_the_runner_state(step_engine):
    engine = step_engine
    stream = engine.add_request(req("doomed", 5))
    engine.step()
    assert set(engine.executor.worker.model_runner.step_states) == {"doomed"}
    assert engine.abort("doomed") == ["doomed"]
    engine.step()                                       # aborts first, then an empty tick retires the state
    assert stream.get(timeout=0).error_type == "request_aborted"
    assert engine.executor.worker.model_runner.step_states == {} and engine.num_request_states() == 0


def test_an_abort_counted_says_the_steps_done_and_the_request_stops_there(step_engine):
    engine = step_engine
    stream = engine.add_request(req("counted", 9))
    engine.step(), engine.step()
    assert engine.abort_counted(["counted", "unknown"]) == {"counted": 2}
    engine.step()
    final = stream.get(timeout=0)
    assert (final.error_type, final.step_index) == ("request_aborted", 2) and engine.num_request_states() == 0


def test_check_request_refuses_what_admission_refuses_and_queues_nothing(step_engine):
    engine = step_engine
    resolved = engine.check_request(req("checked", 3))
    assert (resolved.sampling.height, resolved.sampling.width) == (64, 64) and engine.stats()["waiting"] == 0
    with pytest.raises(InvalidRequestError) as refused:
        engine.check_request(req("odd", 3, width=60))
    assert refused.value.field == "width" and engine.num_request_states() == 0
