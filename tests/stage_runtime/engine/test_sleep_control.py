"""The engine's sleep control (engine.sleep_control, worker.sleep): what survives a level-2 sleep (a loaded LoRA
adapter, compiled graphs with no recompile, the queued request that wakes it), what is refused (level 2 over
quantized weights naming why, sleep on a stage without sleep mode), and a worker that dies asleep fails the engine
closed at the wake."""

from __future__ import annotations

import dataclasses
import os
import signal

import numpy as np
import pytest
from engine_probes import runner_of
from lora_probes import write_adapter

from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.errors import EngineDeadError, InvalidRequestError, RpcError
from stage_runtime.request import DiffusionRequest, SamplingParams
from support.waiting import wait_until


def engine(path: str, warmup: bool = False, **extra) -> DiffusionEngine:
    return DiffusionEngine.make_engine(load_config({
        "model": {"path": path}, "device": "cpu", "warmup": warmup,
        "scheduler": {"execution_mode": "step", "max_num_seqs": 2}, **extra}))


def request(rid: str, **sampling) -> DiffusionRequest:
    return DiffusionRequest(rid, "a cat", SamplingParams(num_inference_steps=3, seed=2, **sampling))


def test_a_lora_adapter_survives_level_2_and_the_queued_request_wakes_the_stage(tiny_sd_path, tmp_path):
    ink = write_adapter(tiny_sd_path, tmp_path / "ink", seed=3, gain=0.3)
    eng = engine(tiny_sd_path, sleep={"enabled": True}, loras=[{"name": "ink", "path": ink}])
    try:
        adapted = {"loras": ({"name": "ink", "scale": 1.0},)}
        before = eng.add_request(request("a", **adapted)).result(timeout=120).images
        eng.collective_rpc("sleep", (2,))
        assert eng.sleep.is_sleeping and eng.sleep.gated
        unet = runner_of(eng).adapter.pipe.unet
        assert all(p.numel() == 0 for p in unet.parameters()), "level 2 left weights in place"
        after = eng.add_request(request("b", **adapted)).result(timeout=120).images
        assert not eng.sleep.is_sleeping and np.array_equal(before, after)
        assert eng.loras.control("list_loras", (), {})[0]["name"] == "ink"
    finally:
        eng.close()


def test_level_2_over_quantized_weights_is_refused_naming_why(tiny_dit_path):
    eng = engine(tiny_dit_path, sleep={"enabled": True}, quantization={"method": "int8-weight"})
    try:
        with pytest.raises(InvalidRequestError) as info:
            eng.collective_rpc("sleep", (2,))
        assert info.value.field == "level" and "quantization.method='int8-weight'" in str(info.value)
        assert not eng.sleep.gated and eng.collective_rpc("sleep", (1,))["level"] == 1       # level 1 is fine
        assert eng.collective_rpc("wake_up")["is_sleeping"] is False
    finally:
        eng.close()


def test_sleep_and_the_profiler_on_a_stage_without_them_are_rpc_errors(tiny_dit_path):
    eng = engine(tiny_dit_path)
    try:
        for method in ("sleep", "wake_up", "start_profile"):
            with pytest.raises(RpcError, match="is off on this stage"):
                eng.collective_rpc(method)
    finally:
        eng.close()


def test_a_worker_that_dies_asleep_fails_the_engine_closed_at_the_wake(tiny_dit_path):
    eng = engine(tiny_dit_path, sleep={"enabled": True}, executor="mp")
    try:
        eng.collective_rpc("sleep", (2,))
        os.kill(eng.executor.procs[0].pid, signal.SIGKILL)
        stream = eng.add_request(request("woken"))            # queued: it starts the wake, which finds no rank
        with pytest.raises(EngineDeadError):
            stream.result(timeout=60)
        wait_until(lambda: eng.state == "dead", timeout=30, what="the engine failed closed")
    finally:
        eng.close()


def test_compiled_graphs_survive_level_2_no_recompile_and_the_same_image(tiny_digits_path):
    from support.compile_cache import shared_compile_cache

    eng = engine(tiny_digits_path, sleep={"enabled": True}, executor="mp", warmup=True,
                 compile={"mode": "regional", "cache_dir": str(shared_compile_cache())})
    try:
        digit = DiffusionRequest("a", "3", SamplingParams(num_inference_steps=4, seed=1))
        before = eng.add_request(digit).result(timeout=120).images
        eng.collective_rpc("sleep", (2,))
        after = eng.add_request(dataclasses.replace(digit, request_id="b")).result(timeout=120).images
        (stats,) = eng.collective_rpc("compile_stats")
    finally:
        eng.close()
    assert np.array_equal(before, after)
    assert stats["recompiles"] == 0 and stats["mode_effective"] == "regional", stats
