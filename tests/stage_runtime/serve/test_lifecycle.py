"""The stage process's lifecycle as a real process: SIGTERM drain (exit 0; a running video job handed off at a
checkpoint), fail closed on worker death (exit 3 within 2 s, WorkerDied in the termination log), startup errors
(exit 2). Each test spawns its own stage and checks that it leaves no process and no /dev/shm segment behind."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import httpx
import pytest
from serve_probes import LONG_STEPS, decode_png, wait_running, wait_until
from stage_process import StageProcess

from stage_runtime.checkpoint import read_manifest
from stage_runtime.client import StageClient
from stage_runtime.errors import EngineDeadError
from stage_runtime.jobs.store.file_leases import FileLeases
from stage_runtime.jobs.store.filesystem import FileJobStore
from stage_runtime.jobs.store import CHECKPOINT


@pytest.fixture
def spawn(tmp_path):
    stages: list[StageProcess] = []

    def start(args: list[str], wait_ready: bool = True) -> StageProcess:
        stage = StageProcess(args, tmp_path / f"stage-{len(stages)}.log", tmp_path / f"termination-{len(stages)}")
        stages.append(stage)
        return stage.start(wait_ready=wait_ready)

    yield start
    for stage in stages:
        stage.kill()


async def test_sigterm_finishes_running_work_aborts_the_rest_at_the_timeout_and_exits_0(spawn, tiny_sd_path,
                                                                                          stage_topology):
    stage = spawn(["--model", tiny_sd_path, "--max-num-seqs", "1", "--drain-timeout", "8", *stage_topology])
    async with httpx.AsyncClient(base_url=stage.http_url, timeout=60) as http:
        short = asyncio.create_task(http.post("/v1/images/generations",
                                              json={"prompt": "x", "num_inference_steps": 8, "request_id": "short"}))
        await wait_running(http, "short")
        long = asyncio.create_task(http.post("/v1/images/generations",       # waits behind "short"
                                             json={"prompt": "x", "num_inference_steps": LONG_STEPS,
                                                   "request_id": "long"}))
        await wait_until(lambda: _stats_has(http, waiting=1), what="long waiting")
        stage.signal(signal.SIGTERM)
        await wait_until(lambda: _status_is(http, "/ready", 503), what="/ready 503 while draining")
        assert (await http.get("/health")).status_code == 200                  # alive while draining
        assert (await http.get("/v1/stats")).json()["state"] == "draining"
        refused = await http.post("/v1/images/generations", json={"prompt": "x"})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "stage_unavailable"

        done = await short                                                     # finished within the grace
        assert done.status_code == 200, done.text
        assert decode_png(done.json()["data"][0]["b64_json"]).shape == (64, 64, 3)
        cut = await long                                                       # aborted at the drain timeout
        assert cut.status_code == 503
        error = cut.json()["error"]
        assert error["type"] == "request_aborted" and "drain timeout (8 s) expired" in error["message"]
    assert stage.wait(30) == 0, stage.log[-3000:]
    assert "drained (1 request(s) aborted" in stage.log
    assert not stage.termination_log.exists()
    stage.assert_no_leaks()


async def test_sigterm_hands_a_running_video_job_off_at_a_checkpoint_without_waiting_out_the_drain(spawn, tiny_wan_path,
                                                                                                 tmp_path):
    """A replica with a job store, its rank a worker process: SIGTERM while a 999-step job runs. The job is written to
    its checkpoint, put back in the queue at that step with its lease released, and the process exits 0 long before
    its 600 s drain timeout."""
    store = tmp_path / "store"
    stage = spawn(["--model", tiny_wan_path, "--served-name", "tiny-wan", "--execution-mode", "step", "--executor",
                   "mp", "--job-store", str(store), "--job-checkpoint-every-steps", "2", "--drain-timeout", "600"])
    async with httpx.AsyncClient(base_url=stage.http_url, timeout=60) as http:
        created = await http.post("/v1/videos", json={"prompt": "a fox", "size": "16x16", "num_frames": 9,
                                                       "num_inference_steps": 999})
        assert created.status_code == 200, created.text
        job = created.json()["id"]

        async def checkpointed() -> bool:
            return ((await http.get(f"/v1/videos/{job}")).json()["diffstage"]["checkpoint_step"] or 0) >= 2

        await wait_until(checkpointed, timeout=60, what="a checkpoint of the running job")
        started = time.monotonic()
        stage.signal(signal.SIGTERM)
        assert stage.wait(60) == 0, stage.log[-3000:]
    assert time.monotonic() - started < 60 and "handed off 1 video job(s) at the drain" in stage.log
    record = FileJobStore(store).get(job)
    assert (record.status, record.owner, record.attempts) == ("queued", None, 1)
    assert 2 <= record.checkpoint_step == record.step < 999 and "as it drained" in record.requeued_because
    assert read_manifest(str(store / "jobs" / job / CHECKPOINT))["step"] == record.checkpoint_step
    assert FileLeases(FileJobStore(store), "other", 30).free(job)
    stage.assert_no_leaks()


async def test_worker_death_fails_closed_with_exit_3(spawn, tiny_sd_path, fault_topology):
    stage = spawn(["--model", tiny_sd_path, "--max-num-seqs", "1", *fault_topology])
    async with httpx.AsyncClient(base_url=stage.http_url, timeout=60) as http, StageClient(stage.zmq_url) as zmq:
        in_flight = asyncio.create_task(http.post("/v1/images/generations",
                                                  json={"prompt": "x", "num_inference_steps": LONG_STEPS,
                                                        "request_id": "doomed"}))
        await wait_running(http, "doomed")
        queued = await zmq.add_request("x", request_id="doomed-zmq", num_inference_steps=2)
        await wait_until(lambda: _stats_has(http, waiting=1), what="zmq request waiting")
        workers = (await http.get("/v1/stats")).json()["workers"]
        victim = workers[-1]
        stage.track()
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = time.monotonic()

        answer = await in_flight
        assert answer.status_code == 503
        error = answer.json()["error"]
        assert error["type"] == "engine_dead" and f"pid {victim['pid']}" in error["message"]
        with pytest.raises(EngineDeadError, match="killed by signal 9"):
            await queued.result(timeout=5)
        health = await http.get("/health")
        assert health.status_code == 503 and "killed by signal 9" in health.json()["error"]["message"]
        assert (await http.get("/ready")).status_code == 503
    code = stage.wait(15)
    elapsed = time.monotonic() - killed_at
    assert code == 3, stage.log[-3000:]
    # an exit, not a hang (2.4 s seen on a loaded machine; bench/fail_closed.py measures the reaction)
    assert elapsed < 15.0, f"exit 3 took {elapsed:.2f} s after the worker died"
    message = stage.termination_log.read_text()
    assert message.startswith("WorkerDied: ") and message.count("\n") == 1
    assert f"rank {victim['rank']} (pid {victim['pid']}) killed by signal 9" in message
    stage.assert_no_leaks()


async def test_sigkill_of_the_stage_itself_leaves_no_worker_and_no_segment(spawn, tiny_sd_path, stage_topology):
    stage = spawn(["--model", tiny_sd_path, *stage_topology])
    async with httpx.AsyncClient(base_url=stage.http_url, timeout=60) as http, StageClient(stage.zmq_url) as zmq:
        stream = await zmq.add_request("x", request_id="orphaned", num_inference_steps=LONG_STEPS)
        await wait_running(http, "orphaned")
        stage.signal(signal.SIGKILL)                 # no drain, no close, no atexit: the workers are on their own
        with pytest.raises(EngineDeadError, match="lost the connection to the stage"):
            await stream.result(timeout=10)          # the client does not wait forever for a dead stage
    assert stage.wait(10) == -signal.SIGKILL
    stage.assert_no_leaks()


def test_bad_topology_exits_2_with_the_reason_in_the_termination_log(spawn, tiny_sd_path):
    stage = spawn(["--model", tiny_sd_path, "--num-gpus", "3", "--cfg-parallel-size", "2"], wait_ready=False)
    assert stage.wait(60) == 2
    message = stage.termination_log.read_text()
    assert message.startswith("ConfigError: ") and message.count("\n") == 1
    assert "num_gpus=3" in message and "cfg_parallel_size(2)" in message
    assert "Traceback" not in stage.log
    stage.assert_no_leaks()


@pytest.mark.parametrize("case", ["more-ranks-than-devices", "missing-model"])
def test_startup_errors_exit_2(spawn, tiny_sd_path, tmp_path, case):
    import torch

    if case == "more-ranks-than-devices":
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        args = ["--model", tiny_sd_path, "--device", "cuda", "--executor", "mp",
                "--data-parallel-size", str(visible + 1)]
        expected = ("ConfigError: device='cuda'", f"needs {visible + 1} CUDA device(s)", f"{visible} are visible")
    else:
        args = ["--model", str(tmp_path / "nowhere"), "--device", "cpu"]
        expected = ("ModelLoadError: ", "nowhere")
    stage = spawn(args, wait_ready=False)
    assert stage.wait(120) == 2, stage.log[-3000:]
    message = stage.termination_log.read_text()
    assert all(part in message for part in expected), message
    stage.assert_no_leaks()


def test_unexpected_startup_failure_exits_1(spawn, tiny_sd_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        stage = spawn(["--model", tiny_sd_path, "--device", "cpu", "--http-port", str(port)], wait_ready=False)
        assert stage.wait(60) == 1, stage.log[-3000:]
    message = stage.termination_log.read_text()
    assert message.startswith("OSError: ") and str(port) in message
    stage.assert_no_leaks()


async def _status_is(http: httpx.AsyncClient, path: str, status: int) -> bool:
    return (await http.get(path)).status_code == status


async def _stats_has(http: httpx.AsyncClient, **expected: int) -> bool:
    stats = (await http.get("/v1/stats")).json()
    return all(stats[k] == v for k, v in expected.items())
