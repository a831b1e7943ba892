"""MultiprocExecutor with real rank processes on the real tiny SD pipeline: results, RPC, async output, shared
memory, progress and abort in request mode, either start method, and that nothing is left behind."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest

from engine_probes import max_diff, phased, progress_of, wait_until
from executors_for_tests import ComputeDoneFirst, OutputReadyFirst
from mp_probes import assert_released, mp_engine, req, segments
from stage_runtime.config import load_config
from stage_runtime.engine.engine import DiffusionEngine
from stage_runtime.errors import RequestAbortedError, RpcError
from stage_runtime.executor.messages import RpcMessage
from stage_runtime.executor.procs import start_fork_server
from stage_runtime.process_tree import proc_stat


@pytest.fixture(scope="module")
def engine(tiny_sd_path):
    eng = mp_engine(tiny_sd_path, max_num_seqs=4)
    yield eng
    eng.close()
    eng.executor.shutdown()                 # idempotent
    eng.close()
    assert_released(eng)


@pytest.fixture(scope="module")
def uni_engine(tiny_sd_path):
    eng = DiffusionEngine.make_engine(load_config({"model": {"path": tiny_sd_path}, "device": "cpu",
                                                   "executor": "uni", "warmup": False}))
    yield eng
    eng.close()


def assert_idle(eng) -> None:
    wait_until(lambda: eng.executor.num_pending() == 0, timeout=5)
    assert eng.num_request_states() == 0 and eng.scheduler.num_states == 0
    assert eng.collective_rpc("num_request_states") == [0]
    assert segments(eng.executor.shm_prefix) == []


def test_one_rank_mp_equals_uni(engine, uni_engine):
    a = engine.add_request(req("mp", "a red cat", 4, 7)).result(60)
    b = uni_engine.add_request(req("uni", "a red cat", 4, 7)).result(60)
    assert a.images.shape == (1, 64, 64, 3)
    assert max_diff(a.images, b.images) <= 1
    assert_idle(engine)


def parent_pid(pid: int) -> int:
    stat = proc_stat(pid)
    assert stat is not None, f"rank {pid} is gone"
    return stat[0]


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_rank_starts_with_the_engine_process_environment_by_either_method(method, tiny_sd_path, uni_engine,
                                                                             monkeypatch, tmp_path):
    """forkserver (the default) forks the rank from a server process started before the variable below existed;
    the rank still sees the engine process's environment as it is at the rank's start, as a spawned rank does."""
    start_fork_server("mp", "forkserver")
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("DIFFSTAGE_TEST_TRACE", str(trace))
    eng = mp_engine(tiny_sd_path, adapter="adapters_for_tests:TracingSDAdapter", start_method=method)
    try:
        (rank,) = eng.executor.procs
        forked = parent_pid(rank.pid) != os.getpid()          # a forked rank is the fork server's child
        out = eng.add_request(req("env", "a red cat", 4, 7)).result(60)
    finally:
        eng.close()
    assert_released(eng)
    assert forked == (method == "forkserver")
    assert [json.loads(line)["pid"] for line in trace.read_text().splitlines()] == [rank.pid]
    assert max_diff(out.images, uni_engine.add_request(req("env-uni", "a red cat", 4, 7)).result(60).images) <= 1


def test_control_rpc_answers_per_rank_with_status(engine):
    (info,) = engine.collective_rpc("worker_info")
    assert info["rank"] == 0 and info["pid"] == engine.executor.procs[0].pid
    assert engine.collective_rpc("ping", unique_reply_rank=0) == 0
    with pytest.raises(RpcError, match=r"^method='no_such_method' is not a control RPC"):
        engine.collective_rpc("no_such_method")
    # The rank checks again: a control message that bypasses the executor's check is refused there too.
    (reply,) = engine.executor._call(RpcMessage(0, "load_model"), [0], 30).values()
    assert not reply.ok and reply.error.startswith("RpcError: method='load_model' is not a control RPC")
    assert engine.executor.workers() == [{"rank": 0, "pid": info["pid"], "alive": True}]
    assert engine.collective_rpc("ping", unique_reply_rank=0) == 0      # the rank survived the error


def test_fused_batch_results_map_back_by_request_id(engine, uni_engine):
    streams = {i: engine.add_request(req(f"b{i}", f"prompt {i}", 3, i)) for i in range(3)}
    for i, stream in streams.items():
        solo = uni_engine.add_request(req(f"solo{i}", f"prompt {i}", 3, i)).result(60)
        assert max_diff(stream.result(60).images, solo.images) <= 2
    assert_idle(engine)


def test_request_mode_progress_streams_in_order_through_the_ranks(engine):
    items = list(engine.add_request(req("p", "a red cat", 5, 1, stream=True)))
    assert progress_of(items) == phased(5) and items[-1].finished and items[-1].ok
    assert_idle(engine)


def test_abort_of_a_running_request_lands_within_a_few_steps(engine):
    stream = engine.add_request(req("long", "a red cat", 400, 1, stream=True))
    while stream.get(timeout=30).step_index < 2:
        pass
    assert engine.abort("long") == ["long"]
    with pytest.raises(RequestAbortedError):
        stream.result(timeout=10)
    assert_idle(engine)


def test_100_aborted_requests_leave_nothing_behind(engine):
    rng = random.Random(7)
    streams = [engine.add_request(req(f"a{i}", "a red cat", rng.randint(2, 6), i)) for i in range(100)]
    for i in rng.sample(range(100), 100):
        engine.abort(f"a{i}")
    outcomes = {"aborted": 0, "completed": 0}
    for stream in streams:
        try:
            stream.result(60)
            outcomes["completed"] += 1
        except RequestAbortedError:
            outcomes["aborted"] += 1
    assert outcomes["aborted"] >= 90, outcomes     # the first wave may finish before its abort lands
    assert_idle(engine)


# -- COMPUTE_DONE / OUTPUT_READY in both orders ----------------------------------------------------------------
# Both also move every image over 1 KB through shared memory (executors_for_tests: their ranks' shm_threshold),
# so these tests exercise the segments' whole life as well.

@pytest.mark.parametrize("executor_class", [OutputReadyFirst, ComputeDoneFirst])
def test_async_output_in_either_order_delivers_exactly_one_result(tiny_sd_path, uni_engine, executor_class):
    eng = mp_engine(tiny_sd_path, executor_class=executor_class, max_num_seqs=2)
    try:
        ref = uni_engine.add_request(req("ref", "a red cat", 3, 5)).result(60)
        items = list(eng.add_request(req("x", "a red cat", 3, 5)))
        assert len(items) == 1 and items[0].finished and max_diff(items[0].images, ref.images) <= 1
        big = eng.add_request(req("x2", "a red cat", 2, 5, num_outputs=3)).result(60)
        assert big.images.shape == (3, 64, 64, 3)
        if executor_class is ComputeDoneFirst:
            # computed, images still on their way: an abort now drops them (delivered once, as aborted)
            stream = eng.add_request(req("y", "a red cat", 2, 5))
            wait_until(lambda: eng.outputs.awaits_images("y"), timeout=30)
            assert eng.abort("y") == ["y"]
            with pytest.raises(RequestAbortedError):
                stream.result(5)
            assert len(eng.executor.outputs) == 1                   # remembered as dropped until it arrives
        wait_until(lambda: eng.executor.num_pending() == 0, timeout=5)
        assert eng.num_request_states() == 0 and segments(eng.executor.shm_prefix) == []
        assert eng.counters == {"finished_total": 2, "aborted_total": int(executor_class is ComputeDoneFirst),
                                "failed_total": 0}
    finally:
        eng.close()
    assert_released(eng)


def test_two_engines_images_are_identical_across_runs(engine):
    a = engine.add_request(req("s1", "same", 3, 11)).result(60)
    b = engine.add_request(req("s2", "same", 3, 11)).result(60)
    np.testing.assert_array_equal(a.images, b.images)
