"""Offload through the real engine: continuous batching in step mode (requests joining and leaving, a
failing request, an abort), request-mode errors and aborts, and one multiprocess rank — images equal the
no-offload engine's, the offloader holds nothing once idle, stats come through ``collective_rpc``, and
close or a SIGKILLed worker leave no file behind."""

from __future__ import annotations

import os
import signal

import pytest

from engine_probes import max_diff, runner_of, wait_until
from mp_probes import assert_released
from offload_probes import offload_mappings, req
from stage_runtime.config import load_config
from stage_runtime.engine.engine import DiffusionEngine
from stage_runtime.errors import EngineDeadError, RequestAbortedError, RequestFailedError


def engine(path: str, offload: dict | None = None, adapter: str | None = None, executor: str = "uni",
           **scheduler) -> DiffusionEngine:
    return DiffusionEngine.make_engine(load_config({
        "model": {"path": path, "adapter": adapter}, "device": "cpu", "executor": executor, "warmup": False,
        "scheduler": scheduler, "offload": offload or {}}))


def idle_and_released(eng) -> None:
    wait_until(lambda: eng.num_request_states() == 0, timeout=10)
    offloader = runner_of(eng).offloader
    wait_until(lambda: offloader.manager.measured_resident_bytes() == 0, timeout=5)
    assert runner_of(eng).step_states == {} and offloader.stats()["units_loading"] == 0


def step_scenario(eng) -> dict:
    """Requests of different lengths join and leave; one fails in encode, one late in its steps."""
    streams = {"long": eng.add_request(req("long", "a blue car", steps=8, seed=3)),
               "short": eng.add_request(req("short", "a red fox", steps=3, seed=4, num_outputs=2)),
               "boom": eng.add_request(req("boom", "boom", steps=3)),
               "late": eng.add_request(req("late", "late-boom", steps=5))}
    wait_until(lambda: eng.scheduler.num_states < 4, timeout=30)
    streams["joiner"] = eng.add_request(req("joiner", "a green tree", steps=4, seed=9))
    images = {k: streams[k].result(timeout=60).images for k in ("long", "short", "joiner")}
    for k in ("boom", "late"):
        with pytest.raises(RequestFailedError, match="boom"):
            streams[k].result(timeout=60)
    return images


@pytest.mark.parametrize("mode", ["model", "layerwise"])
def test_step_mode_continuous_batching_equals_no_offload(tiny_sd_path, mode):
    adapter = "adapters_for_tests:StepFaultSDAdapter"
    plain = engine(tiny_sd_path, adapter=adapter, execution_mode="step", max_num_seqs=4)
    try:
        reference = step_scenario(plain)
    finally:
        plain.close()
    eng = engine(tiny_sd_path, {"mode": mode}, adapter=adapter, execution_mode="step", max_num_seqs=4)
    try:
        images = step_scenario(eng)
        for k, ref in reference.items():
            assert max_diff(images[k], ref) <= 1, k            # batch composition may differ: ±1 (uint8)
        idle_and_released(eng)
        aborted = eng.add_request(req("abort-me", steps=200, stream=True))
        aborted.get(timeout=30)
        eng.abort("abort-me")
        with pytest.raises(RequestAbortedError):
            aborted.result(timeout=30)
        idle_and_released(eng)
        assert eng.collective_rpc("offload_stats")[0]["resident_bytes"]["cpu"] == 0
    finally:
        eng.close()
    assert offload_mappings() == []


def test_request_mode_error_and_abort_release(tiny_sd_path):
    eng = engine(tiny_sd_path, {"mode": "layerwise"}, adapter="adapters_for_tests:RecordingSDAdapter",
                 max_num_seqs=2)
    try:
        with pytest.raises(RequestFailedError, match="boom"):
            eng.add_request(req("boom", "boom please")).result(timeout=60)
        idle_and_released(eng)
        stream = eng.add_request(req("long", steps=200, stream=True))
        stream.get(timeout=30)
        eng.abort("long")
        with pytest.raises(RequestAbortedError):
            stream.result(timeout=30)
        idle_and_released(eng)
        assert eng.add_request(req("fine")).result(timeout=60).ok
        idle_and_released(eng)
    finally:
        eng.close()
    assert offload_mappings() == []


def test_one_mp_rank_with_offload(tiny_sd_path, tmp_path):
    plain = engine(tiny_sd_path)
    try:
        reference = plain.add_request(req("ref", steps=3, seed=7)).result(timeout=60).images
    finally:
        plain.close()
    eng = engine(tiny_sd_path, {"mode": "layerwise", "dir": str(tmp_path)}, executor="mp")
    try:
        result = eng.add_request(req("mp", steps=3, seed=7)).result(timeout=60)
        assert max_diff(result.images, reference) == 0
        (stats,) = eng.collective_rpc("offload_stats")
        assert stats["rank"] == 0 and stats["mode"] == "layerwise" and stats["tier"] == "cpu<->disk"
        assert stats["loads"] > 0 and stats["resident_bytes"] == {"cpu": 0, "disk": stats["managed_bytes"]}
        assert os.listdir(tmp_path) == []              # files are unlinked once mapped: nothing to leak
        os.kill(eng.executor.procs[0].pid, signal.SIGKILL)      # worker death: the kernel drops the mappings
        wait_until(lambda: eng.state == "dead", timeout=10)
        with pytest.raises(EngineDeadError):
            eng.add_request(req("late"))
    finally:
        eng.close()
    assert_released(eng)
    assert os.listdir(tmp_path) == []
