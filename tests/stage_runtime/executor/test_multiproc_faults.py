"""Fail closed: a worker SIGKILLed while idle or mid-request, the engine's own process SIGKILLed, a rank
that cannot start, a startup timeout, a stalled collective. Every path: a clear error naming the rank,
health dead, no process and no /dev/shm segment left, close() prompt."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from mp_probes import assert_released, mp_engine, pid_alive, req, segments, wait_gone
from support.waiting import wait_until
from stage_runtime.config import load_config
from stage_runtime.engine.engine import DiffusionEngine
from stage_runtime.errors import EngineDeadError, EngineStartupError, ModelLoadError


def assert_dead_and_released(eng, killed_rank: int) -> None:
    with pytest.raises(EngineDeadError, match=f"rank {killed_rank} .*killed by signal 9"):
        eng.executor.check_health()
    assert eng.state == "dead"
    with pytest.raises(EngineDeadError):
        eng.add_request(req("late"))
    # the remaining ranks are terminated by the executor itself, before anyone calls close()
    assert wait_gone([p.pid for p in eng.executor.procs], 10) == []
    eng.close()                        # returns (no hang: the test's timeout bounds it; bench/fail_closed.py times it)
    assert_released(eng)


@pytest.mark.parametrize("mode", ["request", "step"])
def test_sigkill_a_worker_while_a_request_runs(tiny_sd_path, mode):
    eng = mp_engine(tiny_sd_path, parallel={"cfg_parallel_size": 2}, execution_mode=mode)
    try:
        stream = eng.add_request(req("victim", steps=500, stream=True))
        stream.get(timeout=60)                                 # it is running
        victim = eng.executor.procs[1]
        os.kill(victim.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match=rf"rank 1 \(pid {victim.pid}\) killed by signal 9 \(SIGKILL\)"):
            stream.result(timeout=30)          # an answer, not a hang (bench/fail_closed.py: how fast)
        assert_dead_and_released(eng, 1)
    finally:
        eng.close()


def test_sigkill_a_worker_while_idle(tiny_sd_path):
    eng = mp_engine(tiny_sd_path, parallel={"data_parallel_size": 2})
    try:
        assert eng.add_request(req("ok")).result(60).ok
        os.kill(eng.executor.procs[0].pid, signal.SIGKILL)
        wait_until(lambda: eng.state == "dead", timeout=30, what="the death noticed with no request in flight")
        assert "rank 0" in eng.dead_reason
        assert_dead_and_released(eng, 0)
    finally:
        eng.close()


ENGINE_CHILD = textwrap.dedent("""
    import sys, time
    from stage_runtime.config import load_config
    from stage_runtime.engine.engine import DiffusionEngine
    if __name__ == "__main__":
        eng = DiffusionEngine.make_engine(load_config({"model": {"path": sys.argv[1]}, "device": "cpu",
                                                      "parallel": {"cfg_parallel_size": 2}, "warmup": False}))
        stream = eng.add_request(__import__("stage_runtime.request", fromlist=["x"]).DiffusionRequest(
            "r", "a cat", __import__("stage_runtime.request", fromlist=["x"]).SamplingParams(
                num_inference_steps=500, stream=True)))
        stream.get(timeout=60)
        from multiprocessing import forkserver
        print(eng.executor.shm_prefix, forkserver._forkserver._forkserver_pid, *[p.pid for p in eng.executor.procs],
              flush=True)
        time.sleep(120)
""")


def test_sigkill_of_the_engine_process_takes_its_workers_down(tiny_sd_path, tmp_path):
    script = tmp_path / "engine_child.py"
    script.write_text(ENGINE_CHILD)
    child = subprocess.Popen([sys.executable, str(script), tiny_sd_path], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        prefix, server, *pids = child.stdout.readline().split()
        pids = [int(p) for p in pids]
        assert len(pids) == 2 and all(pid_alive(p) for p in [*pids, int(server)])
        child.kill()                                           # SIGKILL: no cleanup code runs in the engine
        child.wait(10)
        assert wait_gone(pids, 5) == [], "worker ranks outlived their engine process"
        assert wait_gone([int(server)], 5) == [], "the fork server outlived its engine process"
        wait_until(lambda: segments(prefix) == [], timeout=5, what=f"no /dev/shm segment {prefix}*")
    finally:
        child.kill()
        child.wait(10)


def test_a_rank_that_cannot_load_the_model_fails_startup_naming_it(tmp_path):
    (tmp_path / "empty").mkdir()
    before = {c.pid for c in multiprocessing.active_children()}
    with pytest.raises(ModelLoadError, match=r"worker rank \d \(pid \d+\) failed to start: ModelLoadError: .*"
                                             r"model_index.json"):
        mp_engine(str(tmp_path / "empty"), parallel={"cfg_parallel_size": 2})
    assert {c.pid for c in multiprocessing.active_children()} <= before


def test_startup_timeout_names_the_ranks_and_leaves_nothing_running(tiny_sd_path):
    # a load that never ends, not a short timeout: a fast machine loads the tiny model within any short one
    config = load_config({"model": {"path": tiny_sd_path, "adapter": "adapters_for_tests:NeverLoadsSDAdapter"},
                          "device": "cpu", "executor": "mp", "worker_startup_timeout_s": 0.2, "warmup": False})
    before = {c.pid for c in multiprocessing.active_children()}
    with pytest.raises(EngineStartupError, match=r"worker rank\(s\) \[0\] not ready within "
                                                 r"worker_startup_timeout_s=0.2 s"):
        DiffusionEngine(config)
    assert {c.pid for c in multiprocessing.active_children()} <= before


def test_a_stalled_collective_fails_closed_instead_of_hanging(tiny_sd_path):
    config = load_config({"model": {"path": tiny_sd_path, "adapter": "adapters_for_tests:StallOnRankOneSDAdapter"},
                          "device": "cpu", "parallel": {"cfg_parallel_size": 2}, "collective_timeout_s": 3,
                          "warmup": False})
    eng = DiffusionEngine.make_engine(config)
    try:
        assert eng.add_request(req("fine")).result(60).ok
        stream = eng.add_request(req("stall", "please stall"))
        with pytest.raises(EngineDeadError, match=r"rank 0 \(pid \d+\) exited with code 3: rank 0: .*[Tt]imed out"):
            stream.result(timeout=30)
        assert wait_gone([p.pid for p in eng.executor.procs], 10) == []
    finally:
        eng.close()
    assert_released(eng)
