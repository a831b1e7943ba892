"""The job runner in process, on a real engine (the tiny Wan, step mode) and a real store: a job whose owner stopped
renewing is taken over and run from step 0, or from the checkpoint its owner wrote (another engine: the same frames,
bitwise); a running job checkpoints every few steps; a drain hands a running job off at a checkpoint (back in the
queue, lease free) and another replica resumes it there; a decode that fails after the denoise runs again from the
denoised state alone; a lost lease stops the run and its writes; a job out of attempts fails saying so."""

from __future__ import annotations

import io
import os
import threading
import time
import zipfile

import numpy as np
import pytest
from engine_probes import count_denoiser_calls, threadless
from PIL import Image
from support.waiting import async_wait_until, wait_until

from stage_runtime.config import load_config
from stage_runtime.errors import JobStoreError
from stage_runtime.engine.engine import DiffusionEngine
from stage_runtime.jobs.store.file_leases import FileLeases
from stage_runtime.jobs.record import JobRecord, RunEntry, new_job_id
from stage_runtime.jobs.store.filesystem import FileJobStore
from stage_runtime.jobs.store import CHECKPOINT, OUTPUTS
from stage_runtime.jobs.form import VideoJobRequest
from stage_runtime.jobs.runner import JobRunner
from stage_runtime.serve.metrics import StageMetrics
from stage_runtime.serve.service import StageService
from stage_runtime.videoio import decode_mp4

JOBS = {"lease_s": 1.5, "scan_interval_s": 0.1, "max_attempts": 3, "checkpoint_every_steps": 3}
SILENT = tuple(name for variant, name in OUTPUTS.items() if variant != "audio")   # Wan's outputs: it makes no sound
FINISHED = {"job.json", "lease-00000001.json", "lease-00000002.json", *SILENT}   # no checkpoint, no temp


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
    runner = JobRunner(service, FileJobStore(tmp_path / "store").open(), config.jobs, "tiny-wan", owner="replica-a")
    runner.start()
    yield runner
    await runner.close()
    assert engine.requests_snapshot() == []


async def files_left(runner: JobRunner, job_id: str) -> set[str]:
    """The job's folder once its run here has ended (its lease released after the record's last word)."""
    await async_wait_until(lambda: job_id not in runner.running, timeout=30, what=f"the run of {job_id} ended")
    return set(os.listdir(runner.store.folder(job_id)))


def stored_frames(store: FileJobStore, job_id: str) -> np.ndarray:
    with zipfile.ZipFile(io.BytesIO(store.read_file(job_id, OUTPUTS["frames"]))) as archive:
        return np.stack([np.asarray(Image.open(io.BytesIO(archive.read(n))).convert("RGB"))
                         for n in sorted(archive.namelist())])


def job(store: FileJobStore, steps: int, **fields) -> JobRecord:
    now = time.time()
    record = JobRecord(id=new_job_id(now), model="tiny-wan", prompt="a fox", size="16x16", num_frames=9, fps=8,
                       num_steps=steps, created_at=now, params={"prompt": "a fox", "size": "16x16", "num_frames": 9,
                                                                 "num_inference_steps": steps, "seed": 3}, **fields)
    store.create(record)
    return record


async def record_where(store: FileJobStore, job_id: str, what: str, check) -> JobRecord:
    return await async_wait_until(lambda: (r := store.get(job_id)) is not None and check(r) and r, timeout=60,
                                  what=what)


async def test_a_job_whose_owner_stopped_renewing_is_taken_over_and_run_from_step_zero(runner):
    store = runner.store
    orphan = job(store, 2, status="in_progress", owner="gone-1", attempts=1, step=1, phase="denoise", progress=45,
                 runs=(RunEntry(owner="gone-1", started_at=time.time() - 20),))
    dead = FileLeases(store, "gone-1", 1.5, clock=lambda: time.time() - 10).claim(orphan.id)    # ran out long ago
    assert dead is not None and runner.leases.free(orphan.id)
    done = await record_where(store, orphan.id, "the orphan completed", lambda r: r.status == "completed")
    assert (done.attempts, done.step, done.progress, done.owner, done.outputs) == (2, 2, 100, None, SILENT)
    # the history: the vanished owner's run closed at the step it last reported, then this replica's from step 0
    assert [(r.owner, r.from_step, r.to_step, r.outcome) for r in done.runs] == [
        ("gone-1", 0, 1, "lease_expired"), (runner.owner, 0, 2, "completed")]
    assert done.runs[0].ended_at <= done.runs[1].started_at <= done.runs[1].ended_at <= done.completed_at
    assert runner.leases.current(orphan.id).generation == 2                 # claimed once more, by this replica
    frames, fps = decode_mp4(store.read_file(orphan.id, OUTPUTS["video"]))
    assert frames.shape == (9, 16, 16, 3) and fps == 8


async def test_a_taken_over_job_resumes_from_its_owners_checkpoint_to_the_same_frames(runner, tiny_wan_path):
    """The owner (another engine, threadless: one tick a step) wrote the job's checkpoint at step 4 and died before
    its record said so (regression, a clean-clone run: the lost run was closed at the record's step, before the step
    the next run resumed from); the replica that takes the job over runs steps 5–8 only, the lost run is closed at
    step 4, and the frames equal the owner's uninterrupted run's."""
    store = runner.store
    orphan = job(store, 8, status="in_progress", owner="gone-1", attempts=1, step=3, phase="denoise",
                 checkpoint_step=2, runs=(RunEntry(owner="gone-1", started_at=time.time() - 20),))
    owner = threadless(tiny_wan_path)
    try:
        request = VideoJobRequest.stored(orphan.params).video_request(orphan.id, orphan.fps, None)
        stream = owner.add_request(request)
        for _ in range(4):
            owner.step()
        [saved] = owner.collective_rpc("checkpoint_request", (orphan.id, str(store.folder(orphan.id) / CHECKPOINT)))
        while not stream.finished:
            owner.step()
        uninterrupted = stream.result(timeout=0).images[0]
    finally:
        owner.close()
    assert saved["step"] == 4
    dead = FileLeases(store, "gone-1", 1.5, clock=lambda: time.time() - 10).claim(orphan.id)
    assert dead is not None and runner.leases.free(orphan.id)
    done = await record_where(store, orphan.id, "the orphan completed", lambda r: r.status == "completed")
    assert (done.resumed_from_step, done.attempts, done.step, done.video()["diffstage"]["resumed_from_step"]) == (
        4, 2, 8, 4)
    assert [(r.owner, r.from_step, r.to_step, r.outcome) for r in done.runs] == [
        ("gone-1", 0, 4, "lease_expired"), (runner.owner, 4, 8, "completed")]
    assert np.array_equal(stored_frames(store, orphan.id), uninterrupted)          # bitwise
    assert await files_left(runner, orphan.id) == FINISHED and done.checkpoint_step is None


async def test_a_drain_hands_a_running_job_off_at_a_checkpoint_and_another_replica_resumes_it(runner, config):
    store, service = runner.store, runner.service
    # long enough that the job is still running once its first checkpoint shows in the record, also on a loaded
    # machine (regression, a clean-clone run under load: 60 steps of ~5 ms had all run before the record said so)
    steps = 400
    calls = count_denoiser_calls(service.engine)
    handed = job(store, steps)
    running = await record_where(store, handed.id, "a checkpoint written", lambda r: (r.checkpoint_step or 0) >= 3)
    assert (running.status, running.owner, running.attempts) == ("in_progress", runner.owner, 1)
    assert await runner.hand_off() == [handed.id]
    back = store.get(handed.id)
    at = back.checkpoint_step
    assert (back.status, back.owner, back.step, back.attempts, back.error) == ("queued", None, at, 1, None)
    assert 3 <= at < steps and f"at the checkpoint of step {at}" in back.requeued_because
    # the checkpoint and the stop fall on one tick boundary: the step saved is the last step run
    assert calls[0] == at, (calls[0], at)
    assert (back.handoffs, back.failed_attempts) == (1, 0)            # a hand-off is no failed attempt
    assert [(r.owner, r.from_step, r.to_step, r.outcome) for r in back.runs] == [(runner.owner, 0, at, "handed_off")]
    assert runner.leases.free(handed.id) and runner.leases.current(handed.id).expires_at == 0.0     # released
    assert await service.drain(0.0) == []                              # nothing of the job left to wait for
    other_service = StageService(config, StageMetrics())           # replica B (the same engine stands in for its)
    other_service.attach(service.engine)
    other = JobRunner(other_service, store, config.jobs, "tiny-wan", owner="replica-b")
    other.start()
    try:
        done = await record_where(store, handed.id, "the job completed", lambda r: r.status == "completed")
    finally:
        await other.close()
    assert (done.resumed_from_step, done.attempts, done.step) == (at, 2, steps)
    assert [(r.owner, r.from_step, r.to_step, r.outcome) for r in done.runs] == [
        (runner.owner, 0, at, "handed_off"), ("replica-b", at, steps, "completed")]     # no step ran twice
    assert set(os.listdir(store.folder(handed.id))) == FINISHED


async def test_a_drain_timeout_puts_a_running_job_back_at_its_newest_checkpoint(runner):
    store, service = runner.store, runner.service
    long = job(store, 999)
    running = await record_where(store, long.id, "a checkpoint written", lambda r: (r.checkpoint_step or 0) >= 3)
    assert (running.status, running.owner, running.attempts) == ("in_progress", runner.owner, 1)
    assert await service.drain(0.0) == [long.id]
    await runner.close()
    back = store.get(long.id)
    assert (back.status, back.owner, back.step, back.attempts) == ("queued", None, back.checkpoint_step, 1)
    assert back.checkpoint_step >= 3 and (store.folder(long.id) / CHECKPOINT).is_file()
    assert "drain timeout" in back.requeued_because and back.error is None
    assert runner.leases.free(long.id) and runner.leases.current(long.id).expires_at == 0.0     # released


async def test_a_decode_that_fails_after_the_denoise_is_retried_from_the_denoised_state_alone(runner):
    """The VAE fails its first decode (as an out-of-memory would): the job decodes again from the state the rank saved
    before decoding, and no denoising step runs twice."""
    store, model = runner.store, runner.service.engine.executor.worker.model_runner
    calls, decodes = count_denoiser_calls(runner.service.engine), []

    def first_decode_fails(module, args):
        decodes.append(len(decodes))
        if len(decodes) == 1:
            raise RuntimeError("CUDA out of memory (injected into the VAE's first decode)")

    hook = model.adapter.pipe.vae.post_quant_conv.register_forward_pre_hook(first_decode_fails)
    try:
        retried = job(store, 3)
        done = await record_where(store, retried.id, "the job completed", lambda r: r.status == "completed")
    finally:
        hook.remove()
    assert (done.decode_retries, done.attempts, done.step, len(decodes), calls[0]) == (1, 1, 3, 2, 3)
    assert await files_left(runner, retried.id) == FINISHED - {"lease-00000002.json"}


async def test_a_lost_lease_stops_the_run_and_its_writes(runner):
    store = runner.store
    long = job(store, 999)
    await record_where(store, long.id, "the job running", lambda r: r.step >= 1)
    thief = FileLeases(store, "thief", 1.5, clock=lambda: time.time() + 60).claim(long.id)   # a clock far ahead
    assert thief is not None and thief.generation == 2
    await async_wait_until(lambda: runner.service.engine.requests_snapshot() == [] and not runner.running,
                           timeout=30, what="the run stopped once its lease was lost")
    stopped = store.get(long.id)                  # the run ended without a word: the new owner's to write
    assert (stopped.status, stopped.owner, stopped.error) == ("in_progress", runner.owner, None) and stopped.step < 999
    assert runner.leases.current(long.id) == thief                    # the runner neither renewed nor released


class FlakyStore(FileJobStore):
    """A store that refuses (JobStoreError, as an object store out of reach does) the writes ``refuse`` names, and
    whose listing takes ``listing_s`` seconds (a store answering slowly)."""

    def __init__(self, root):
        super().__init__(root)
        self.refuse: dict[str, int] = {}         # what → how many more times it fails
        self.refused: list[str] = []
        self.listing_s, self.listings = 0.0, 0
        self.answering = threading.Event()       # set: the store answers at once again

    def _maybe_refuse(self, what: str) -> None:
        if self.refuse.get(what, 0) > 0:
            self.refuse[what] -= 1
            self.refused.append(what)
            raise JobStoreError(f"job store out of reach (refusing {what})")

    def put(self, record: JobRecord) -> None:
        self._maybe_refuse(f"record:{record.status}")
        super().put(record)

    def write_file(self, job_id: str, name: str, data: bytes) -> None:
        self._maybe_refuse(name)
        super().write_file(job_id, name, data)

    def ids(self, after=None, limit=None, order="asc"):
        self.listings += 1
        self.answering.wait(self.listing_s)
        return super().ids(after, limit, order)


@pytest.fixture
async def flaky_runner(engine, config, tmp_path):
    service = StageService(config, StageMetrics())
    service.attach(engine)
    runner = JobRunner(service, FlakyStore(tmp_path / "flaky").open(), config.jobs, "tiny-wan", owner="replica-f")
    runner.start()
    yield runner
    await runner.close()
    assert engine.requests_snapshot() == []


async def test_outputs_and_the_last_word_refused_by_the_store_land_once_it_answers_again(flaky_runner):
    """The store refuses the MP4 twice and the completed record twice (out of reach for a moment at the job's end):
    the run tries again while its lease runs, and the job completes with every output; nothing is left half."""
    store = flaky_runner.store
    store.refuse = {OUTPUTS["video"]: 2, "record:completed": 2}
    done = await record_where(store, job(store, 2).id, "the job completed", lambda r: r.status == "completed")
    assert store.refused == [OUTPUTS["video"]] * 2 + ["record:completed"] * 2
    assert done.outputs == SILENT and done.attempts == 1 and len(done.runs) == 1
    # (once the run has ended: its lease's release replaces the lease file through a temp file, regression: a clean-clone
    # run listed the folder mid-release)
    assert await files_left(flaky_runner, done.id) == {"job.json", "lease-00000001.json", *SILENT}


async def test_a_replica_that_lost_a_lease_claims_nothing_until_the_store_answers_cleanly(flaky_runner):
    """Its lease taken (its renewals could not land in time), the run stops without a word and the replica is
    fenced: while a store round trip takes longer than the lease's spare tenth it claims no queued job; once the
    store answers in time it claims again."""
    store = flaky_runner.store
    long = job(store, 999)
    await record_where(store, long.id, "the job running", lambda r: r.step >= 1)
    store.listing_s = 0.5                                         # > SPARE × lease_s (0.15 s)
    FileLeases(store, "thief", 1.5, clock=lambda: time.time() + 60).claim(long.id)
    await async_wait_until(lambda: flaky_runner.fenced is not None, timeout=30, what="the replica fenced")
    waiting = job(store, 2)
    probes = store.listings
    await async_wait_until(lambda: store.listings >= probes + 3, timeout=30, what="three slow probes of the store")
    assert store.get(waiting.id).status == "queued" and flaky_runner.leases.current(waiting.id) is None
    store.answering.set()
    await record_where(store, waiting.id, "the waiting job completed once the store answered",
                       lambda r: r.status == "completed")
    assert flaky_runner.fenced is None


async def test_a_job_out_of_attempts_fails_saying_why(runner):
    store = runner.store
    tired = job(store, 2, attempts=3, requeued_because="the stage is shutting down")
    failed = await record_where(store, tired.id, "the job failed", lambda r: r.status == "failed")
    assert failed.error.code == "too_many_attempts" and "shutting down" in failed.error.message
    assert failed.expires_at > failed.completed_at and failed.attempts == 3


async def test_hand_offs_do_not_count_against_max_attempts(runner):
    """Three drains handed the job over (a rollout, a scale-down, another rollout): it still runs, and completes."""
    store = runner.store
    moved = job(store, 2, attempts=3, handoffs=3, checkpoint_step=None, requeued_because="handed off")
    done = await record_where(store, moved.id, "the job completed", lambda r: r.status != "queued"
                              and r.status != "in_progress")
    assert (done.status, done.attempts, done.handoffs, done.error) == ("completed", 4, 3, None)


class SlowCheckpointStore(FileJobStore):
    """A store whose checkpoint writes end only once the engine has stepped on (a slow object store, at most
    ``timeout`` seconds): were the engine waiting for the write, it could not step, and the write would end at the
    step it began. Each write's start and end are noted with the job's step the engine had reached then."""

    def __init__(self, root, timeout: float):
        super().__init__(root)
        self.timeout, self.writes, self.engine_step = timeout, [], lambda: 0

    def write_file(self, job_id: str, name: str, data: bytes) -> None:
        if name == CHECKPOINT:
            started = self.engine_step()
            try:
                wait_until(lambda: self.engine_step() > started, timeout=self.timeout, what="a step during the write")
            finally:                             # noted either way: the test asserts on the notes
                self.writes.append((started, self.engine_step()))
        super().write_file(job_id, name, data)


async def test_checkpoint_writes_never_block_a_step(engine, config, tmp_path):
    """Every step checkpointed on a store whose writes end only once the engine stepped on: it does step while a
    write is in flight, newer snapshots replace pending ones, and the job's end waits for its last write (its
    checkpoint is then removed)."""
    every_step = config.model_copy(update={"jobs": config.jobs.model_copy(update={"checkpoint_every_steps": 1})})
    store = SlowCheckpointStore(tmp_path / "slow", timeout=5).open()
    service = StageService(every_step, StageMetrics())
    service.attach(engine)
    runner = JobRunner(service, store, every_step.jobs, "tiny-wan", owner="replica-slow")
    slow = job(store, 40)
    # (a write begins after the run started: a request no longer in the engine has done all its steps)
    store.engine_step = lambda: next((r["step"] for r in engine.requests_snapshot() if r["request_id"] == slow.id), 40)
    runner.start()
    try:
        done = await record_where(store, slow.id, "the slow-store job completed", lambda r: r.status == "completed")
    finally:
        await runner.close()
    assert done.checkpoint_step is None and not (store.folder(slow.id) / CHECKPOINT).exists()
    moved = [(a, b) for a, b in store.writes if b > a]
    assert moved, f"the engine did not step during any checkpoint write: {store.writes}"
    assert len(store.writes) < 40, "every snapshot was written: none replaced a pending one"
