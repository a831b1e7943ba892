"""DiffusionEngine on the real tiny SD pipeline (uni executor): the request paths end to end.

Every test ends by asserting the engine, scheduler and runner hold no state for finished requests.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from adapters_for_tests import RecordingSDAdapter
from engine_probes import assert_no_state, count_at_delivery, count_denoiser_calls, wait_until

from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.errors import (
    ConfigError,
    DuplicateRequestError,
    EngineClosedError,
    EngineStartupError,
    InvalidRequestError,
    RequestAbortedError,
    RequestFailedError,
    RpcError,
)
from stage_runtime.request import DiffusionRequest, SamplingParams

RECORDING = "adapters_for_tests:RecordingSDAdapter"


def make_engine(path: str, adapter: str | None = RECORDING, warmup: bool = True, **scheduler) -> DiffusionEngine:
    config = load_config({"model": {"path": path, "adapter": adapter}, "device": "cpu",
                          "scheduler": scheduler, "warmup": warmup})
    return DiffusionEngine.make_engine(config)


def req(rid: str, prompt: str = "a cat", steps: int = 3, seed: int = 1, **kw) -> DiffusionRequest:
    return DiffusionRequest(rid, prompt, SamplingParams(num_inference_steps=steps, seed=seed, **kw))






@pytest.fixture
def engine(tiny_sd_path):
    RecordingSDAdapter.calls = []
    eng = make_engine(tiny_sd_path, max_num_seqs=4, request_batch_max_wait_ms=300)
    RecordingSDAdapter.calls = []              # forget the warmup call
    yield eng
    eng.close()


def test_one_request(engine):
    out = engine.add_request(req("a")).result(timeout=60)
    assert out.images.shape == (1, 64, 64, 3) and out.images.dtype == np.uint8
    assert out.step_index == 3 and out.metrics["e2e_ms"] >= out.metrics["exec_ms"] > 0
    assert 0 < out.metrics["compute_ms"] <= out.metrics["exec_ms"]      # the pipeline call alone
    assert engine.counters["finished_total"] == 1
    assert_no_state(engine)


def test_same_seed_same_image_different_seed_different(engine):
    a = engine.add_request(req("a", seed=7)).result(timeout=60)
    b = engine.add_request(req("b", seed=7)).result(timeout=60)
    c = engine.add_request(req("c", seed=8)).result(timeout=60)
    assert np.array_equal(a.images, b.images)
    assert not np.array_equal(a.images, c.images)


def test_compatible_requests_run_as_one_fused_call_and_match_alone(engine):
    batch = [req("a", "a red fox", seed=1), req("b", "a blue car", seed=2, num_outputs=2),
             req("c", "a cat", seed=3, negative_prompt="blurry")]
    streams = [engine.add_request(r) for r in batch]
    fused = {s.request_id: s.result(timeout=60).images for s in streams}
    assert RecordingSDAdapter.calls == [["a", "b", "c"]]          # ONE pipeline call for the wave
    for r in batch:
        alone = engine.add_request(req("solo-" + r.request_id, r.prompt, seed=r.sampling.seed,
                                       num_outputs=r.sampling.num_outputs,
                                       negative_prompt=r.sampling.negative_prompt)).result(timeout=60)
        assert fused[r.request_id].shape == alone.images.shape
        diff = np.abs(fused[r.request_id].astype(int) - alone.images.astype(int)).max()
        assert diff <= 2, f"{r.request_id}: fused differs from alone by {diff}"
    assert RecordingSDAdapter.calls[1:] == [["solo-a"], ["solo-b"], ["solo-c"]]
    assert_no_state(engine)


def test_incompatible_requests_run_in_separate_calls(engine):
    s1 = engine.add_request(req("a", steps=3))
    s2 = engine.add_request(req("b", steps=4))
    s1.result(timeout=60), s2.result(timeout=60)
    assert RecordingSDAdapter.calls == [["a"], ["b"]]


def test_duplicate_request_id_rejected(engine):
    s = engine.add_request(req("dup", steps=30))
    with pytest.raises(DuplicateRequestError, match="dup"):
        engine.add_request(req("dup"))
    s.result(timeout=60)
    engine.add_request(req("dup")).result(timeout=60)         # reusable once delivered
    assert_no_state(engine)


def test_invalid_request_rejected_at_admission(engine):
    with pytest.raises(InvalidRequestError, match="width=60"):
        engine.add_request(req("a", width=60))
    # regression: 1000 steps passed the edge and failed inside DDIM (steps_offset=1) with an IndexError
    with pytest.raises(InvalidRequestError, match=r"num_inference_steps=1000: .*at most 999"):
        engine.add_request(DiffusionRequest("b", "x", SamplingParams(num_inference_steps=1000)))
    assert_no_state(engine)


def test_pipeline_error_fails_only_that_request(engine):
    boom = engine.add_request(req("boom", "boom please", seed=1))
    mate = engine.add_request(req("mate", "a dog", seed=2))
    with pytest.raises(RequestFailedError, match="boom requested"):
        boom.result(timeout=60)
    assert mate.result(timeout=60).images is not None            # batch-mate unaffected
    assert RecordingSDAdapter.calls == [["boom", "mate"], ["boom"], ["mate"]]
    assert engine.add_request(req("after")).result(timeout=60).ok   # engine keeps serving
    assert engine.counters["failed_total"] == 1 and engine.state == "ready"
    assert_no_state(engine)


def test_missing_output_is_an_error(engine):
    with pytest.raises(RequestFailedError, match="No output result for request lost"):
        engine.add_request(req("lost", "drop me")).result(timeout=60)
    assert_no_state(engine)


def test_abort_waiting_request(tiny_sd_path):
    eng = make_engine(tiny_sd_path, max_num_seqs=1)
    try:
        running = eng.add_request(req("long", steps=200))
        waiting = eng.add_request(req("queued"))
        assert eng.abort("queued") == ["queued"]
        with pytest.raises(RequestAbortedError, match="Request queued aborted"):
            waiting.result(timeout=60)
        assert eng.abort(["nope"]) == []
        eng.abort("long")
        with pytest.raises(RequestAbortedError):
            running.result(timeout=60)
        assert eng.counters["aborted_total"] == 2
        assert_no_state(eng)
    finally:
        eng.close()



def test_abort_running_alone_stops_within_one_step(engine):
    calls = count_denoiser_calls(engine)
    stream = engine.add_request(req("long", steps=500))
    wait_until(lambda: calls[0] >= 3)
    at_abort = calls[0]
    engine.abort("long")
    with pytest.raises(RequestAbortedError):
        stream.result(timeout=60)
    assert calls[0] - at_abort <= 1          # the next step's hook interrupted the pipeline call
    assert_no_state(engine)
    assert engine.add_request(req("next")).result(timeout=60).ok


def test_abort_running_in_fused_batch_ends_within_one_step_and_mate_completes(engine):
    calls = count_denoiser_calls(engine)
    victim = engine.add_request(req("victim", "a fox", steps=60, seed=1))
    mate = engine.add_request(req("mate", "a car", steps=60, seed=2))
    wait_until(lambda: calls[0] >= 3)
    delivered = count_at_delivery(victim, calls)
    at_abort = calls[0]
    engine.abort("victim")
    with pytest.raises(RequestAbortedError):
        victim.result(timeout=60)
    assert delivered[0] - at_abort <= 1      # delivered at the next step, while the mate still runs
    assert not mate.finished
    fused = mate.result(timeout=60)
    assert RecordingSDAdapter.calls[0] == ["victim", "mate"]
    alone = engine.add_request(req("alone", "a car", steps=60, seed=2)).result(timeout=60)
    assert np.abs(fused.images.astype(int) - alone.images.astype(int)).max() <= 2
    assert_no_state(engine)


async def test_async_stream(engine):
    stream = engine.add_request(req("a"))
    items = [item async for item in stream]
    assert len(items) == 1 and items[0].finished and items[0].ok
    out = await engine.add_request(req("b")).aresult()
    assert out.images.shape == (1, 64, 64, 3)


async def test_async_abort_raises(engine):
    stream = engine.add_request(req("long", steps=400))
    engine.abort("long")
    with pytest.raises(RequestAbortedError):
        await stream.aresult()


def test_collective_rpc_runs_on_the_loop_and_times_out_while_busy(engine):
    assert engine.collective_rpc("ping") == [0]
    assert engine.collective_rpc("ping", unique_reply_rank=0) == 0
    stream = engine.add_request(req("long", steps=100))
    wait_until(lambda: engine.requests_snapshot() and engine.requests_snapshot()[0]["step"] >= 1)
    with pytest.raises(RpcError, match=r"collective_rpc 'ping' got no answer within timeout=0.01 s"):
        engine.collective_rpc("ping", timeout=0.01)
    engine.abort("long")
    with pytest.raises(RequestAbortedError):
        stream.result(timeout=60)
    assert engine.collective_rpc("ping") == [0]


def test_requests_snapshot_shows_progress(engine):
    stream = engine.add_request(req("long", steps=100))
    wait_until(lambda: any(r["step"] >= 2 for r in engine.requests_snapshot()))
    snap = engine.requests_snapshot()
    assert snap[0]["request_id"] == "long" and snap[0]["state"] == "running" and snap[0]["num_steps"] == 100
    engine.abort("long")
    with pytest.raises(RequestAbortedError):
        stream.result(timeout=60)
    assert engine.requests_snapshot() == []


def test_close_fails_pending_streams_and_is_idempotent(tiny_sd_path):
    eng = make_engine(tiny_sd_path, max_num_seqs=1)
    running = eng.add_request(req("long", steps=500))
    waiting = eng.add_request(req("queued"))
    wait_until(lambda: eng.requests_snapshot()[0]["step"] >= 1)
    eng.close()
    for stream in (running, waiting):
        with pytest.raises(EngineClosedError, match="DiffusionEngine is closed."):
            stream.result(timeout=5)
    eng.close()                                     # idempotent
    assert eng.state == "closed" and eng.executor.worker is None
    with pytest.raises(EngineClosedError, match="closed"):
        eng.add_request(req("late"))
    with pytest.raises(EngineClosedError):
        eng.collective_rpc("ping")
    assert not [t for t in threading.enumerate() if t.name == "diffusion-engine"]


def test_warmup_failure_closes_engine(tiny_sd_path):
    with pytest.raises(EngineStartupError, match="Warmup failed.*cannot generate"):
        make_engine(tiny_sd_path, adapter="adapters_for_tests:AlwaysFailingSDAdapter")
    assert not [t for t in threading.enumerate() if t.name == "diffusion-engine"]


def test_batching_needs_a_batch_capable_pipeline(tiny_sd_path):
    with pytest.raises(ConfigError, match="max_num_seqs=2.*cannot fuse"):
        make_engine(tiny_sd_path, adapter="adapters_for_tests:SingleRequestSDAdapter", max_num_seqs=2)
    eng = make_engine(tiny_sd_path, adapter="adapters_for_tests:SingleRequestSDAdapter", warmup=False)
    assert eng.generate("a cat", num_inference_steps=2).ok
    eng.close()


def test_step_mode_without_step_contract_fails_at_startup(tiny_sd_path):
    with pytest.raises(ConfigError, match="execution_mode='step'.*does not implement step execution"):
        make_engine(tiny_sd_path, adapter="adapters_for_tests:RequestOnlySDAdapter", execution_mode="step")
    with pytest.raises(ConfigError, match="streaming_output needs step mode"):
        make_engine(tiny_sd_path, adapter="adapters_for_tests:RequestOnlySDAdapter", streaming_output=True)


def test_dit_pipeline_serves_class_prompts(tiny_dit_path):
    eng = make_engine(tiny_dit_path, adapter=None, max_num_seqs=2)
    try:
        a = eng.generate("207", num_inference_steps=3, seed=3)
        b = eng.generate("207", num_inference_steps=3, seed=3)
        assert a.images.shape == (1, 64, 64, 3) and np.array_equal(a.images, b.images)
        with pytest.raises(InvalidRequestError, match="height=96"):
            eng.generate("1", height=96)
        before = eng.stats()
        with pytest.raises(InvalidRequestError, match="^prompt='5000': class id must be < 1000") as err:
            eng.generate("5000")                       # refused at admission: never queued, never on the rank
        assert err.value.field == "prompt" and eng.stats() == before
        assert_no_state(eng)
    finally:
        eng.close()
