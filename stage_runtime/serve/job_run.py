"""One video job's run on this replica (``serve.job_runner`` claims the jobs and starts a :class:`JobRun` each).

The run holds the job's lease, renewing it every third of it (a lost lease stops the run), and runs the job as an
engine request (``StageService.submit``, id = the job id) that streams its progress: each phase and denoising
step goes into the record (``phase``, ``step``, ``progress``; only the newest waits while a write is in flight,
so a slow store never slows the engine). On success the MP4, the thumbnail (the first frame) and the exact
frames are written beside the record, then the record says ``completed``.

While it denoises, the run has the engine snapshot the job's step state (``checkpoint_request``, between two
ticks) after every ``checkpoint_every_steps`` steps, and writes it off the engine's step path
(``serve.checkpoint_writer``: one write in flight, a newer snapshot replacing a pending one;
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

from stage_runtime.checkpoint import read_manifest
from stage_runtime.config import JobsConfig
from stage_runtime.errors import (DiffStageError, EngineDeadError, InvalidRequestError, JobNotFoundError, JobStoreError,
                                  RequestAbortedError)
from stage_runtime.imageio import decode_image
from stage_runtime.jobs.lease import SPARE, Lease, Leases
from stage_runtime.jobs.record import JobError, JobRecord, progress_of
from stage_runtime.jobs.store import CHECKPOINT, OUTPUTS, REFERENCE, JobStore
from stage_runtime.outputs import DiffusionOutput
from stage_runtime.request import DiffusionRequest
from stage_runtime.serve.checkpoint_writer import CheckpointWriter
from stage_runtime.serve.job_form import VideoJobRequest
from stage_runtime.serve.service import StageService
from stage_runtime.serve.videos import frames_zip
from stage_runtime.videoio import encode_mp4, thumbnail_png

if TYPE_CHECKING:
    from stage_runtime.engine import RequestStream

log = logging.getLogger(__name__)
REQUEUE_ERRORS = {"engine_dead", "engine_closed", "stage_unavailable", "queue_full"}   # not the job's fault
CHECKPOINT_TIMEOUT_S = 300.0           # one checkpoint RPC: it waits for the tick in progress, then writes


class JobRun:
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
        # checkpoints: snapshotted between ticks by the engine, written here off its step path (serve.checkpoint_writer)
        self.writes = CheckpointWriter(lease.job_id, lambda data: store.write_file(lease.job_id, CHECKPOINT, data),
                                       on_written=self._written)
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
        while True:
            await asyncio.sleep(self.config.lease_s / 3)
            try:
                renewed = await asyncio.to_thread(self.leases.renew, self.lease)
            except (OSError, ValueError) as exc:
                log.warning("video job %s: lease not renewed: %s", self.job_id, exc)
                if time.time() < self.lease.expires_at - SPARE * self.config.lease_s:
                    continue
                renewed = None
            if renewed is None:
                if not self.deleted:
                    self.lost = True
                    log.warning("video job %s: lease lost; stopping its run here", self.job_id)
                    self.service.abort([self.job_id])
                return
            self.lease = renewed
            await self._write()

    async def _write(self, **changes) -> None:
        """Update the record (the owner alone writes it). A deleted job stops its run at the next step. A write the
        store refuses is logged and the run goes on: the lease, not the record, says who runs the job."""
        if self.deleted or self.lost:
            return
        async with self._lock:
            self.record = self.record.model_copy(update={**changes, "lease_expires_at": self.lease.expires_at,
                                                         "checkpoint_step": self.checkpoint_step})
            try:
                await asyncio.to_thread(self.store.put, self.record)
            except JobNotFoundError:
                self.deleted = True
                log.info("video job %s was deleted: stopping it at its next step", self.job_id)
                self.service.abort([self.job_id])
            except JobStoreError as exc:
                log.warning("video job %s: record not written (%s): %s", self.job_id, changes.get("status"), exc)

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
        request = dataclasses.replace(
            VideoJobRequest.stored(record.params).video_request(record.id, record.fps, reference, stream=True),
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

    @property
    def checkpoint_path(self) -> str:
        return str(self.store.folder(self.job_id) / CHECKPOINT)

    # -- checkpoints ------------------------------------------------------------------------------------------
    def _due(self, phase: str | None, step: int) -> None:
        """After a denoising step: a checkpoint when ``checkpoint_every_steps`` have passed since the newest one."""
        every = self.config.checkpoint_every_steps
        if (not every or phase != "denoise" or step >= self.record.num_steps or self.handing_off
                or step - (self.checkpoint_step or 0) < every
                or (self._checkpointing is not None and not self._checkpointing.done())):
            return
        self._checkpointing = asyncio.get_running_loop().create_task(self.checkpoint())

    async def checkpoint(self, then_stop: bool = False) -> int | None:
        """The job's step state snapshotted at the engine's next tick boundary and handed to the job's writer: the
        step snapshotted, or None (no state to save: not started or already ended; logged). The step counts as the
        job's checkpoint once written (``checkpoint_step``). ``then_stop``: the request is aborted at that same
        boundary (no step runs after the one saved), and this returns once the write is done: the step written."""
        try:
            replies = await asyncio.to_thread(self.service.collective_rpc, "checkpoint_request", (self.job_id, None),
                                              {}, CHECKPOINT_TIMEOUT_S, None, (self.job_id,) if then_stop else ())
        except DiffStageError as exc:
            log.warning("video job %s: no checkpoint: %s", self.job_id, exc)
            return None
        saved = next((reply for reply in replies if reply), None)
        if saved is None or self.deleted or self.lost:
            return None
        if "error" in saved:
            log.warning("video job %s: no checkpoint: %s", self.job_id, saved["error"])
            return None
        self.writes.submit(int(saved["step"]), saved["data"])
        log.info("video job %s: checkpoint of step %d snapshotted (%d bytes, %.3f s)", self.job_id, saved["step"],
                 saved["bytes"], saved["seconds"])
        if then_stop:
            return await self.writes.flush()
        return int(saved["step"])

    def _written(self, step: int) -> None:
        if not (self.deleted or self.lost):
            self.checkpoint_step = step

    def _decode_failed(self, final: DiffusionOutput) -> bool:
        stopped = self.deleted or self.lost or self.handing_off
        return (final.error is not None and self.phase == "decode" and not stopped
                and final.error_type not in REQUEUE_ERRORS and final.error_type != RequestAbortedError.error_type)

    def _saved_step(self) -> int:
        """(A thread.) The step of the job's checkpoint on disk; 0 when there is none or it cannot be read."""
        if not os.path.exists(self.checkpoint_path):
            return 0
        try:
            return int(read_manifest(self.checkpoint_path)["step"])
        except InvalidRequestError:
            return 0

    def _denoised_saved(self) -> bool:
        """(A thread.) Whether the job's checkpoint is its denoised state (the rank saves it before decoding)."""
        return self._saved_step() >= self.record.num_steps

    async def _retry_decode(self, request: DiffusionRequest, failed: DiffusionOutput) -> DiffusionOutput:
        """The decode failed after a full denoise: decode once more from the denoised state (no step runs again)."""
        log.warning("video job %s: its decode failed (%s); decoding again from its denoised state", self.job_id,
                    failed.error)
        self.checkpoint_step = self.record.num_steps
        await self._write(decode_retries=self.record.decode_retries + 1)
        try:
            stream = self.service.submit(dataclasses.replace(request, resume_from=self.checkpoint_path))
        except DiffStageError as exc:
            log.warning("video job %s: the decode retry was not admitted: %s", self.job_id, exc)
            return failed
        final = await self._follow(stream)
        if final.error is not None:
            final.error = f"{final.error} (its decode failed twice; first: {failed.error})"
        return final

    async def hand_off(self, timeout: float) -> None:
        """The replica drains: a checkpoint now, the run stopped, the job back in the queue at the checkpoint's step
        and the lease released (another replica resumes it)."""
        self.handing_off = True
        if self._checkpointing is not None:
            await asyncio.gather(self._checkpointing, return_exceptions=True)
        # the run's end waits for this checkpoint (its step is where the job goes back in the queue)
        self._checkpointing = asyncio.get_running_loop().create_task(self.checkpoint(then_stop=True))
        await asyncio.gather(self._checkpointing, return_exceptions=True)
        self.service.abort([self.job_id])        # (when no checkpoint could be taken: stop it all the same)
        try:
            await asyncio.wait_for(self.done.wait(), timeout)
        except TimeoutError:
            log.error("video job %s still running %g s after its hand-off", self.job_id, timeout)

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
        await self._write(phase="mux", step=final.step_index or record.num_steps,
                          progress=progress_of("mux", record.num_steps, record.num_steps))
        if self.deleted:
            return
        files = await asyncio.to_thread(lambda: {OUTPUTS["video"]: encode_mp4(frames, record.fps),
                                                 OUTPUTS["thumbnail"]: thumbnail_png(frames),
                                                 OUTPUTS["frames"]: frames_zip(frames)})
        try:
            for name, data in files.items():
                await asyncio.to_thread(self.store.write_file, record.id, name, data)
        except JobNotFoundError:
            self.deleted = True
            return
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
        await self._write(status=status, phase=None, owner=None, completed_at=now,
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
        await self._write(status="queued", owner=None, phase=None, step=step, started_at=None, requeued_because=why,
                          progress=progress_of("denoise", step, self.record.num_steps), handoffs=handoffs,
                          runs=self.record.with_run_ended("handed_off" if handed_off else "requeued", step,
                                                          time.time()))
