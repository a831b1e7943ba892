"""The job runner in process, on a real engine (the tiny Wan, step mode) and a real store: a job whose owner stopped
renewing is taken over and run from step 0; a drain puts a running job back in the queue with its lease free; a
lost lease stops the run and its writes; a job out of attempts fails saying so."""

from __future__ import annotations

import time

import pytest
from support.waiting import async_wait_until

from stage_runtime.config import load_config
from stage_runtime.engine.engine import DiffusionEngine
from stage_runtime.jobs.lease import Leases
from stage_runtime.jobs.record import JobRecord, new_job_id
from stage_runtime.jobs.store import OUTPUTS, JobStore
from stage_runtime.serve.job_runner import JobRunner
from stage_runtime.serve.metrics import StageMetrics
from stage_runtime.serve.service import StageService
from stage_runtime.videoio import decode_mp4

JOBS = {"lease_s": 1.5, "scan_interval_s": 0.1, "max_attempts": 3}


@pytest.fixture(scope="module")
def config(tiny_wan_path):
    return load_config({"model": {"path": tiny_wan_path, "served_name": "tiny-wan"}, "device": "cpu",
                        "warmup": False, "scheduler": {"execution_mode": "step"}, "jobs": JOBS})


@pytest.fixture(scope="module")
def engine(config):
    engine = DiffusionEngine.make_engine(config)
    yield engine
    engine.close()


@pytest.fixture
async def runner(engine, config, tmp_path):
    service = StageService(config, StageMetrics())
    service.attach(engine)
    runner = JobRunner(service, JobStore(tmp_path / "store").open(), config.jobs, "tiny-wan")
    runner.start()
    yield runner
    await runner.close()
    assert engine.requests_snapshot() == []


def job(store: JobStore, steps: int, **fields) -> JobRecord:
    now = time.time()
    record = JobRecord(id=new_job_id(now), model="tiny-wan", prompt="a fox", size="16x16", num_frames=9, fps=8,
                       num_steps=steps, created_at=now, params={"prompt": "a fox", "size": "16x16", "num_frames": 9,
                                                                 "num_inference_steps": steps, "seed": 3}, **fields)
    store.create(record)
    return record


async def record_where(store: JobStore, job_id: str, what: str, check) -> JobRecord:
    return await async_wait_until(lambda: (r := store.get(job_id)) is not None and check(r) and r, timeout=60,
                                  what=what)


async def test_a_job_whose_owner_stopped_renewing_is_taken_over_and_run_from_step_zero(runner):
    store = runner.store
    orphan = job(store, 2, status="in_progress", owner="gone-1", attempts=1, step=1, phase="denoise", progress=45)
    dead = Leases(store, "gone-1", 1.5, clock=lambda: time.time() - 10).claim(orphan.id)    # ran out long ago
    assert dead is not None and runner.leases.free(orphan.id)
    done = await record_where(store, orphan.id, "the orphan completed", lambda r: r.status == "completed")
    assert (done.attempts, done.step, done.progress, done.owner, done.outputs) == (2, 2, 100, None, tuple(OUTPUTS.values()))
    assert runner.leases.current(orphan.id).generation == 2                 # claimed once more, by this replica
    frames, fps = decode_mp4(store.read_file(orphan.id, OUTPUTS["video"]))
    assert frames.shape == (9, 16, 16, 3) and fps == 8


async def test_a_drain_puts_a_running_job_back_in_the_queue_with_its_lease_free(runner):
    store, service = runner.store, runner.service
    long = job(store, 999)
    running = await record_where(store, long.id, "the job running", lambda r: r.step >= 2)
    assert (running.status, running.owner, running.attempts) == ("in_progress", runner.owner, 1)
    assert await service.drain(0.0) == [long.id]
    await runner.close()
    back = store.get(long.id)
    assert (back.status, back.owner, back.step, back.progress, back.attempts) == ("queued", None, 0, 0, 1)
    assert "drain timeout" in back.requeued_because and back.error is None
    assert runner.leases.free(long.id) and runner.leases.current(long.id).expires_at == 0.0     # released


async def test_a_lost_lease_stops_the_run_and_its_writes(runner):
    store = runner.store
    long = job(store, 999)
    await record_where(store, long.id, "the job running", lambda r: r.step >= 1)
    thief = Leases(store, "thief", 1.5, clock=lambda: time.time() + 60).claim(long.id)   # a clock far ahead
    assert thief is not None and thief.generation == 2
    await async_wait_until(lambda: runner.service.engine.requests_snapshot() == [] and not runner.running,
                           timeout=30, what="the run stopped once its lease was lost")
    stopped = store.get(long.id)                  # the run ended without a word: the new owner's to write
    assert (stopped.status, stopped.owner, stopped.error) == ("in_progress", runner.owner, None) and stopped.step < 999
    assert runner.leases.current(long.id) == thief                    # the runner neither renewed nor released


async def test_a_job_out_of_attempts_fails_saying_why(runner):
    store = runner.store
    tired = job(store, 2, attempts=3, requeued_because="the stage is shutting down")
    failed = await record_where(store, tired.id, "the job failed", lambda r: r.status == "failed")
    assert failed.error.code == "too_many_attempts" and "shutting down" in failed.error.message
    assert failed.expires_at > failed.completed_at and failed.attempts == 3
