"""Parallel ranks through the whole engine: CFG parallel and Ulysses (2 gloo ranks each) give the
single-rank image for the same seed; data parallel runs two requests at once on different ranks; a step checkpoint
of two CFG ranks is written by their leader alone and resumed on both."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from engine_probes import max_diff, phased, progress_of, wait_until
from mp_probes import assert_released, mp_engine, req
from stage_runtime.config import load_config
from stage_runtime.engine.engine import DiffusionEngine
from stage_runtime.errors import ConfigError, RequestAbortedError

TOLERANCE = 2          # uint8 levels: row-split and all_to_all change float summation order, nothing else


def single_rank(path: str, mode: str, requests) -> dict:
    eng = DiffusionEngine.make_engine(load_config({
        "model": {"path": path}, "device": "cpu", "executor": "uni", "warmup": False,
        "scheduler": {"execution_mode": mode, "max_num_seqs": len(requests)}}))
    try:
        return {r.request_id: eng.add_request(r).result(120).images for r in requests}
    finally:
        eng.close()


CASES = [  # (model, parallel, mode): each model and each mode meets each parallel plan once
    ("sd", {"cfg_parallel_size": 2}, "request"),
    ("dit", {"cfg_parallel_size": 2}, "step"),
    ("sd", {"ulysses_degree": 2}, "step"),
    ("dit", {"ulysses_degree": 2}, "request"),
]


@pytest.mark.parametrize(("model", "parallel", "mode"), CASES, ids=lambda v: str(v))
def test_two_rank_plans_equal_one_rank(model, parallel, mode, tiny_sd_path, tiny_dit_path):
    path = tiny_sd_path if model == "sd" else tiny_dit_path
    prompt = "a red cat" if model == "sd" else "207"
    # step mode batches different step counts; request mode fuses same-key requests
    steps = (3, 5) if mode == "step" else (4, 4)
    requests = lambda: [req("a", prompt, steps[0], 1), req("b", prompt, steps[1], 2)]   # noqa: E731
    expected = single_rank(path, mode, requests())
    eng = mp_engine(path, parallel=parallel, execution_mode=mode, max_num_seqs=2)
    try:
        assert eng.executor.world_size == 2
        streams = [eng.add_request(r) for r in requests()]
        for stream in streams:
            images = stream.result(120).images
            assert max_diff(images, expected[stream.request_id]) <= TOLERANCE
        if mode == "step":        # streaming and a step-granular abort across the ranks
            long = eng.add_request(req("long", prompt, 400, 3, stream=True))
            short = eng.add_request(req("short", prompt, 4, 4, stream=True))
            assert progress_of(short) == phased(4)
            assert eng.abort("long") == ["long"]
            with pytest.raises(RequestAbortedError):
                long.result(30)
        wait_until(lambda: eng.executor.num_pending() == 0, timeout=5)
        wait_until(lambda: eng.collective_rpc("num_request_states") == [0, 0], timeout=5)
    finally:
        eng.close()
    assert_released(eng)


def test_data_parallel_runs_two_requests_at_once_on_different_ranks(tiny_sd_path, tmp_path, monkeypatch):
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("DIFFSTAGE_TEST_TRACE", str(trace))          # inherited by the spawned ranks
    expected = single_rank(tiny_sd_path, "request", [req("a", "a red cat", 6, 1), req("b", "a blue dog", 6, 2)])
    eng = mp_engine(tiny_sd_path, parallel={"data_parallel_size": 2}, adapter="adapters_for_tests:TracingSDAdapter",
                    max_num_seqs=2)
    try:
        streams = [eng.add_request(req("a", "a red cat", 6, 1)), eng.add_request(req("b", "a blue dog", 6, 2))]
        for stream in streams:
            assert max_diff(stream.result(120).images, expected[stream.request_id]) <= TOLERANCE
        calls = [json.loads(line) for line in trace.read_text().splitlines()]
        pids = {w["pid"] for w in eng.executor.workers()}
    finally:
        eng.close()
    assert_released(eng)
    assert sorted(c["ids"] for c in calls) == [["a"], ["b"]]          # one request per DP rank
    assert {c["pid"] for c in calls} == pids and len(pids) == 2
    first, second = sorted(calls, key=lambda c: c["start"])
    assert second["start"] < first["end"], "the two DP ranks did not run concurrently"


def test_a_step_checkpoint_of_two_cfg_ranks_is_written_by_the_leader_and_both_ranks_resume_from_it(tiny_dit_path,
                                                                                                     tmp_path):
    """The engine without its thread (each ``step()`` one tick): the leader alone writes the state after step 3, and a
    request resuming from it on both ranks makes the uninterrupted run's image, bitwise."""
    path = str(tmp_path / "c.safetensors")
    eng = DiffusionEngine(load_config({"model": {"path": tiny_dit_path}, "device": "cpu", "executor": "mp",
                                       "warmup": False, "parallel": {"cfg_parallel_size": 2},
                                       "scheduler": {"execution_mode": "step", "max_num_seqs": 1}}))
    try:
        stream = eng.add_request(req("a", "207", 6, 1))
        for _ in range(3):
            eng.step()
        saved, other = eng.collective_rpc("checkpoint_request", ("a", path))
        assert saved["step"] == 3 and other is None and os.listdir(tmp_path) == ["c.safetensors"]
        while not stream.finished:
            eng.step()
        resumed = eng.add_request(dataclasses.replace(req("b", "207", 6, 1), resume_from=path))
        while not resumed.finished:
            eng.step()
        assert np.array_equal(resumed.result(0).images, stream.result(0).images)
        assert eng.collective_rpc("num_request_states") == [0, 0]
    finally:
        eng.close()
    assert_released(eng)


def test_ulysses_degree_that_does_not_divide_the_heads_is_rejected_at_load(tiny_sd_path):
    with pytest.raises(ConfigError, match=r"worker rank \d \(pid \d+\) failed to start: ConfigError: .*ulysses"):
        mp_engine(tiny_sd_path, parallel={"ulysses_degree": 3})
