"""One video job's run on this replica (``jobs.runner`` claims the jobs and starts a :class:`JobRun` each).

The run holds the job's lease, renewing it every third of it (a lost lease stops the run), and runs the job as an
engine request (``StageService.submit``, id = the job id) that streams its progress: each phase and denoising
step goes into the record (``phase``, ``step``, ``progress``; only the newest waits while a write is in flight,
so a slow store never slows the engine). On success the MP4, the thumbnail (the first frame) and the exact
frames are written beside the record, then the record says ``completed``.

While it denoises, the run has the engine snapshot the job's step state (``checkpoint_request``, between two
ticks) after every ``checkpoint_every_steps`` steps, and writes it off the engine's step path
(``jobs.checkpoint_writer``: one write in flight, a newer snapshot replacing a pending one;
``jobs/<id>/checkpoint.safetensors``, replaced whole); the record says the step written (``checkpoint_step``). A run of a job that has a checkpoint starts from it (the engine request
carries ``resume_from``; ``resumed_from_step`` in the record); one the engine refuses (another model, another
request) is left aside and the job runs from step 0. A completed job's checkpoint is removed.

A job deleted while it runs stops at its next step: at once when the DELETE reaches this replica
(:meth:`JobRun.cancel`), else when the run's next record write finds the job gone. A draining replica hands its
runs off (:meth:`JobRun.hand_off`: a checkpoint now, the request stopped, the job back in the queue at that step,
the lease released). A run ended for another reason not the job's own (the drain timeout, a dead engine) puts the
job back in the queue at its newest checkpoint, ``max_attempts`` runs at most; the job's own failure (a failed
pipeline call, its deadline) is ``failed`` with the error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from contextlib import aclosing
from typing import TYPE_CHECKING

from stage_runtime.audioio import encode_wav
from stage_runtime.checkpoint import read_manifest
from stage_runtime.config import JobsConfig
from stage_runtime.errors import (DiffStageError, EngineDeadError, InvalidRequestError, JobNotFoundError, JobStoreError,
                                  RequestAbortedError)
from stage_runtime.imageio import decode_image
from stage_runtime.jobs.checkpoint_writer import CheckpointWriter
from stage_runtime.jobs.form import VideoJobRequest
from stage_runtime.jobs.lease import Lease, Leases, usable
from stage_runtime.jobs.record import JobError, JobRecord, progress_of
from stage_runtime.jobs.run_checkpoints import REQUEUE_ERRORS, RunCheckpoints
from stage_runtime.jobs.store import CHECKPOINT, OUTPUTS, REFERENCE, VIDEO_INPUT, JobStore
from stage_runtime.outputs import DiffusionOutput
from stage_runtime.request import DiffusionRequest
from stage_runtime.serve.service import StageService
from stage_runtime.serve.videos import frames_zip
from stage_runtime.video_request import VideoInput
from stage_runtime.videoio import encode_mp4, thumbnail_png

if TYPE_CHECKING:
    from stage_runtime.engine import RequestStream

log = logging.getLogger(__name__)
STORE_RETRY_S = 1.0                    # a store write that must land (outputs, the last word) is retried this often


class JobRun(RunCheckpoints):
    def __init__(self, service: StageService, store: JobStore, leases: Leases, config: JobsConfig, lease: Lease,
                 record: JobRecord, closing: Callable[[], bool]):
        self.service, self.store, self.leases, self.config = service, store, leases, config
        self.lease, self.record, self._closing = lease, record, closing
        self.done = asyncio.Event()
        self.deleted = False                   # the job left the store: stop, write nothing
        self.lost = False                      # the lease is lost: another replica may run it now
        self.backoff = False                   # the engine could not take it now: no immediate rescan
        self.stopped_at: int | None = None     # the steps done when the run ended
        self.checkpoint_step = record.checkpoint_step    # the step of the job's newest checkpoint
        self.resumed_from: int | None = None   # the checkpoint's step this run started from
        self.handing_off = False               # the replica drains: the run stops at a checkpoint, the job requeues
        self.phase: str | None = None          # the engine request's phase, as last reported
        self._checkpointing: asyncio.Task | None = None
        # checkpoints: snapshotted between ticks by the engine, written here off its step path (jobs.checkpoint_writer)
        self.writes = CheckpointWriter(lease.job_id, lambda data: store.write_file(lease.job_id, CHECKPOINT, data),
                                       on_written=self._written, retry_while=self._may_retry,
                                       retry_s=min(STORE_RETRY_S, config.lease_s / 10))
        self._lock = asyncio.Lock()
        self._pending: dict | None = None      # the newest progress not yet written
        self._writer: asyncio.Task | None = None

    @property
    def job_id(self) -> str:
        return self.lease.job_id

    async def run(self) -> None:
        """The job, start to end, under its lease; then the lease back (a finished job's stays with its files)."""
        renewing = asyncio.get_running_loop().create_task(self._renew())
        try:
            await self._run()
        except OSError as exc:                 # JobStoreError too: reading the record's inputs
            log.error("video job %s: the store failed; its lease is released for a retry: %s", self.job_id, exc)
        finally:
            renewing.cancel()
            try:
                if not (self.deleted or self.lost):
                    await asyncio.to_thread(self.leases.release, self.lease)
            finally:
                self._drop_scratch()
                self.done.set()                # (after the release: a hand-off returns with the lease free)

    async def cancel(self, timeout: float) -> dict[str, int]:
        """The job was deleted: stop it at its next step and wait until it has stopped. {step_at_delete,
        stopped_at_step}: the steps done when the abort was registered, and when the run ended."""
        self.deleted = True
        at = self.service.abort_counted([self.job_id]).get(self.job_id, self.record.step)
        try:
            await asyncio.wait_for(self.done.wait(), timeout)
        except TimeoutError:
            log.error("video job %s still running %g s after its delete", self.job_id, timeout)
        return {"step_at_delete": at, "stopped_at_step": self.stopped_at if self.stopped_at is not None else at}

    # -- the lease and the record ---------------------------------------------------------------------------
    async def _renew(self) -> None:
        """Every third of the lease. A store that cannot be reached is tried again while the lease still runs with
        its spare tenth left; then the lease counts as lost, as it soon is for the other replicas."""
        wait = self.config.lease_s / 3
        while True:
            await asyncio.sleep(wait)
            try:
                renewed = await asyncio.to_thread(self.leases.renew, self.lease)
            except (OSError, ValueError) as exc:
                log.warning("video job %s: lease not renewed: %s", self.job_id, exc)
                if usable(self.leases, self.lease):
                    wait = min(STORE_RETRY_S, self.config.lease_s / 10)     # try again soon: the store may be back
                    continue
                renewed = None
            wait = self.config.lease_s / 3
            if renewed is None:
                if not self.deleted:
                    self.lost = True
                    self.writes.fence()
                    log.warning("video job %s: lease lost; stopping its run here, writing nothing more", self.job_id)
                    self.service.abort([self.job_id])
                return
            self.lease = renewed
            await self._write()

    def _may_retry(self) -> bool:
        """Whether a store write that failed is worth another try: the run still holds a usable lease."""
        return not (self.deleted or self.lost) and usable(self.leases, self.lease)

    async def _write(self, must_land: bool = False, **changes) -> None:
        """Update the record (the owner alone writes it). A deleted job stops its run at the next step. A progress
        write the store refuses is logged and the run goes on: the lease, not the record, says who runs the job. A
        write that ``must_land`` (the run's last word) is tried again while the lease runs: the store may be back."""
        if self.deleted or self.lost:
            return
        async with self._lock:
            self.record = self.record.model_copy(update={**changes, "lease_expires_at": self.lease.expires_at,
                                                         "checkpoint_step": self.checkpoint_step})
            await self._store(self.store.put, self.record, must_land=must_land, what=f"record ({changes.get('status')})")

    async def _store(self, call, *args, must_land: bool = True, what: str = "") -> bool:
        """One store call in a thread; False when the job was deleted meanwhile (the run stops) or the call could not
        land (refused, and ``must_land`` not asked or the lease ran out meanwhile)."""
        while True:
            try:
                await asyncio.to_thread(call, *args)
                return True
            except JobNotFoundError:
                self.deleted = True
                log.info("video job %s was deleted: stopping it at its next step", self.job_id)
                self.service.abort([self.job_id])
                return False
            except JobStoreError as exc:
                log.warning("video job %s: %s not written: %s", self.job_id, what, exc)
                if not (must_land and self._may_retry()):
                    return False
            await asyncio.sleep(min(STORE_RETRY_S, self.config.lease_s / 10))

    def _report(self, **changes) -> None:
        """The run's phase and step: written as soon as the last write is done, the newest only."""
        self._pending = changes
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        while self._pending is not None:
            changes, self._pending = self._pending, None
            await self._write(**changes)

    async def _settle(self) -> None:
        """Progress writes done (dropped when not yet begun): the next write is the last word."""
        self._pending = None
        if self._writer is not None:
            await self._writer

    # -- the run ----------------------------------------------------------------------------------------------
    async def _run(self) -> None:
        # a run its owner left open (killed, partitioned) ended when its lease expired, at the furthest step known:
        # its checkpoint on disk may be newer than its record (the owner died between writing the two)
        await asyncio.to_thread(self._fetch_checkpoint)
        saved = await asyncio.to_thread(self._saved_step)
        record = self.record = self.record.model_copy(update={"runs": self.record.with_run_ended(
            "lease_expired", max(self.record.reached_step, saved), time.time())})
        if record.failed_attempts >= self.config.max_attempts:
            await self._fail_tired(record.requeued_because or "with its replica")
            return
        try:
            request = await asyncio.to_thread(self._request, record)
            stream, request = self._submit(request)
        except InvalidRequestError as exc:
            await self._finish("failed", error=JobError(code=exc.error_type, message=str(exc), param=exc.field))
            return
        except DiffStageError as exc:            # the engine cannot take it now (full, draining, dead): not a run
            self.backoff = True
            log.info("video job %s not started here: %s: %s", record.id, type(exc).__name__, exc)
            return
        start, now = self.resumed_from or 0, time.time()
        await self._write(status="in_progress", owner=self.leases.owner, attempts=record.attempts + 1,
                          started_at=now, phase=None, step=start, resumed_from_step=self.resumed_from,
                          progress=progress_of("denoise", start, record.num_steps),
                          runs=record.with_run_started(self.leases.owner, start, now))
        final = await self._follow(stream)
        if self._decode_failed(final) and await asyncio.to_thread(self._denoised_saved):
            final = await self._retry_decode(request, final)
        self.stopped_at = final.step_index
        if self._checkpointing is not None:
            await asyncio.gather(self._checkpointing, return_exceptions=True)
        await self.writes.flush()                # the job's last word comes after its last checkpoint write
        if self.deleted or self.lost:
            return
        if final.error is None:
            await self._complete(final)
        elif final.error_type == RequestAbortedError.error_type and self.handing_off:
            await self._requeue(f"handed off by {self.leases.owner} as it drained, at the checkpoint of step "
                                f"{self.checkpoint_step or 0}", handed_off=True)
        elif final.error_type in REQUEUE_ERRORS or (final.error_type == RequestAbortedError.error_type
                                                    and (self.service.draining or self._closing())):
            await self._requeue(final.error)
        else:
            await self._finish("failed", error=JobError(code=final.error_type or "request_failed", message=final.error))

    def _request(self, record: JobRecord) -> DiffusionRequest:
        """(A thread.) The engine request of the job: the stored fields, the stored reference picture."""
        reference = None
        if record.reference:
            reference = decode_image(self.store.read_file(record.id, REFERENCE), "input_reference",
                                     self.service.config.server.max_image_pixels)
        video = VideoInput.from_bytes(self.store.read_file(record.id, VIDEO_INPUT)) if record.video_input else None
        request = dataclasses.replace(
            VideoJobRequest.stored(record.params).video_request(record.id, record.fps, reference, stream=True,
                                                                video_input=video),
            save_denoised_to=self.checkpoint_path)
        self.resumed_from = self.checkpoint_step = None
        if not os.path.exists(self.checkpoint_path):
            return request
        try:
            self.resumed_from = self.checkpoint_step = int(read_manifest(self.checkpoint_path)["step"])
        except InvalidRequestError as exc:
            log.warning("video job %s: its checkpoint is not usable; it runs from step 0: %s", record.id, exc)
            return request
        return dataclasses.replace(request, resume_from=self.checkpoint_path)

    def _submit(self, request: DiffusionRequest) -> tuple[RequestStream, DiffusionRequest]:
        """The job's engine request admitted (its stream, the request); one whose checkpoint the engine refuses
        (another model, another request) runs from step 0."""
        try:
            return self.service.submit(request), request
        except InvalidRequestError as exc:
            if request.resume_from is None or exc.field != "resume_from":
                raise
            log.warning("video job %s: the engine refuses its checkpoint; it runs from step 0: %s", self.job_id, exc)
            self.resumed_from = self.checkpoint_step = None
            request = dataclasses.replace(request, resume_from=None)
            return self.service.submit(request), request

    async def _follow(self, stream) -> DiffusionOutput:
        """Consume the request's items to its final one, reporting each phase and step."""
        async with aclosing(self.service.outputs(stream)) as items:
            async for item in items:
                if item.finished:
                    await self._settle()
                    return item
                step, steps, self.phase = item.step_index or 0, item.num_steps or self.record.num_steps, item.phase
                self._report(phase=item.phase, step=step, progress=progress_of(item.phase, step, steps))
                self._due(item.phase, step)
        await self._settle()
        raise EngineDeadError(f"the stream of video job {self.job_id} ended without its final item")

    async def _complete(self, final: DiffusionOutput) -> None:
        frames, record = final.images[0], self.record
        audio = None if final.audio is None else final.audio.track(0)
        await self._write(phase="mux", step=final.step_index or record.num_steps,
                          progress=progress_of("mux", record.num_steps, record.num_steps))
        if self.deleted:
            return
        files = await asyncio.to_thread(lambda: {OUTPUTS["video"]: encode_mp4(frames, record.fps, audio=audio),
                                                 OUTPUTS["thumbnail"]: thumbnail_png(frames),
                                                 OUTPUTS["frames"]: frames_zip(frames),
                                                 **({} if audio is None else {OUTPUTS["audio"]: encode_wav(audio)})})
        for name, data in files.items():
            if not await self._store(self.store.write_file, record.id, name, data, what=name):
                return                           # deleted meanwhile, or the lease ran out: another run finishes it
        await self._finish("completed", outputs=tuple(files))

    async def _finish(self, status: str, **changes) -> None:
        """The job's end: its checkpoint removed (nothing resumes a finished job), the record's last word."""
        try:
            await asyncio.to_thread(self.store.remove_file, self.job_id, CHECKPOINT)
            self.checkpoint_step = None
        except JobStoreError as exc:
            log.warning("video job %s: its checkpoint stays until the job expires: %s", self.job_id, exc)
        now = time.time()
        to_step = self.record.num_steps if status == "completed" else \
            self.stopped_at if self.stopped_at is not None else self.record.step
        await self._write(must_land=True, status=status, phase=None, owner=None, completed_at=now,
                          expires_at=now + self.config.retention_s,
                          progress=100 if status == "completed" else self.record.progress,
                          runs=self.record.with_run_ended(status, to_step, now), **changes)
        log.info("video job %s %s (run %d)", self.job_id, status, self.record.attempts)

    async def _fail_tired(self, why: str) -> None:
        await self._finish("failed", error=JobError(code="too_many_attempts", message=(
            f"ran {self.record.attempts} times without finishing (jobs.max_attempts); the last run ended: {why}")))

    async def _requeue(self, why: str, handed_off: bool = False) -> None:
        """Back in the queue for any replica (at its newest checkpoint), or failed after ``max_attempts`` runs that
        were not hand-offs (a drain handing a job over is no failure of it)."""
        handoffs = self.record.handoffs + handed_off
        if self.record.model_copy(update={"handoffs": handoffs}).failed_attempts >= self.config.max_attempts:
            await self._fail_tired(why)
            return
        step = self.checkpoint_step or 0
        log.info("video job %s back in the queue at step %d (%s)", self.job_id, step, why)
        await self._write(must_land=True, status="queued", owner=None, phase=None, step=step, started_at=None, requeued_because=why,
                          progress=progress_of("denoise", step, self.record.num_steps), handoffs=handoffs,
                          runs=self.record.with_run_ended("handed_off" if handed_off else "requeued", step,
                                                          time.time()))
