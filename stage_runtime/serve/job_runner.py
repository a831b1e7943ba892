"""The jobs of the shared store that this replica runs through its own engine (docs/http-api.md "Video jobs").

Every ``scan_interval_s`` (and at once after a create here or a job of its own ending) the runner sweeps
expired jobs and, while the stage is ready, claims the oldest claimable jobs of its model — queued ones, and
in-progress ones whose owner stopped renewing its lease — until it runs ``max_num_seqs`` of them. A claimed job
runs as an engine request (``StageService.submit``, id = the job id) that streams its progress: each phase and
denoising step is written into the record (``phase``, ``step``, ``progress``). A background task renews the
lease every third of it; a lost lease stops the run. On success the MP4, the thumbnail (the first frame) and the
exact frames are written beside the record, then the record says ``completed``.

A job deleted while it runs stops at its next step: at once when the DELETE reaches this replica
(:meth:`JobRunner.cancel`), else when the runner's next record write finds the job gone. A run ended for a
reason not the job's own (the drain, a dead engine, a full queue) puts the job back in the queue for any replica,
from step 0, ``max_attempts`` runs at most; the job's own failure (a failed pipeline call, its deadline) is
``failed`` with the error. (Step checkpoints and resuming from them are to come; the record's ``step`` and the
lease are their seams.)
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from contextlib import aclosing
from dataclasses import dataclass, field

from stage_runtime.config import JobsConfig
from stage_runtime.errors import (DiffStageError, EngineDeadError, InvalidRequestError, JobNotFoundError, JobStoreError,
                                  RequestAbortedError)
from stage_runtime.imageio import decode_image
from stage_runtime.jobs.lease import SPARE, Lease, Leases
from stage_runtime.jobs.record import ACTIVE, JobError, JobRecord, progress_of
from stage_runtime.jobs.store import OUTPUTS, REFERENCE, JobStore
from stage_runtime.outputs import DiffusionOutput
from stage_runtime.serve.job_form import VideoJobRequest
from stage_runtime.serve.service import StageService
from stage_runtime.serve.videos import frames_zip
from stage_runtime.videoio import encode_mp4, thumbnail_png

log = logging.getLogger(__name__)
REQUEUE_ERRORS = {"engine_dead", "engine_closed", "stage_unavailable", "queue_full"}   # not the job's fault
CLOSE_WAIT_S = 30.0


def replica_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass
class RunningJob:
    lease: Lease
    record: JobRecord
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    deleted: bool = False                  # the job left the store: stop, write nothing
    lost: bool = False                     # the lease is lost: another replica may run it now
    stopped_at: int | None = None          # the steps done when the run ended
    backoff: bool = False                  # the engine could not take it: no immediate rescan
    pending: dict | None = None            # the latest progress not yet written (older ones are skipped)
    writer: asyncio.Task | None = None     # writes ``pending`` while the engine goes on


class JobRunner:
    def __init__(self, service: StageService, store: JobStore, config: JobsConfig, model: str,
                 owner: str | None = None):
        self.service, self.store, self.config, self.model = service, store, config, model
        self.owner = owner or replica_name()
        self.leases = Leases(store, self.owner, config.lease_s)
        self.running: dict[str, RunningJob] = {}
        self._tasks: set[asyncio.Task] = set()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._closing = False

    # -- the scan loop --------------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._scan_loop())

    def wake(self) -> None:
        self._wake.set()

    @property
    def capacity(self) -> int:
        return self.service.config.scheduler.max_num_seqs

    async def _scan_loop(self) -> None:
        while not self._closing:
            try:
                await self._scan()
            except OSError as exc:                          # JobStoreError too: the store is unreachable
                log.warning("job store scan failed (retrying in %g s): %s", self.config.scan_interval_s, exc)
            except Exception:
                log.exception("job scan failed (retrying in %g s)", self.config.scan_interval_s)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self.config.scan_interval_s)
            except TimeoutError:
                pass                                        # the periodic scan

    async def _scan(self) -> None:
        expired = await asyncio.to_thread(self.store.sweep)
        if expired:
            log.info("expired %d video job(s): %s", len(expired), ", ".join(expired))
        if self._closing or self.service.state != "ready" or len(self._tasks) >= self.capacity:
            return
        for lease in await asyncio.to_thread(self._claim, self.capacity - len(self._tasks)):
            self._spawn(lease)

    def _claim(self, room: int) -> list[Lease]:
        """(A thread.) Up to ``room`` leases on the oldest claimable jobs of this model."""
        claimed = []
        for record in self.store.records():
            if len(claimed) >= room:
                break
            if record.model != self.model or record.status not in ACTIVE or record.id in self.running \
                    or record.expired(self.store.clock()):
                continue
            lease = self.leases.claim(record.id)
            if lease is not None:
                claimed.append(lease)
        return claimed

    def _spawn(self, lease: Lease) -> None:
        task = asyncio.get_running_loop().create_task(self._own(lease))
        self._tasks.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("a video job run failed", exc_info=task.exception())

    # -- one job --------------------------------------------------------------------------------------------
    async def _own(self, lease: Lease) -> None:
        """Hold the lease while the job runs, then give it back (a finished job's lease stays with its files)."""
        record = await asyncio.to_thread(self.store.get, lease.job_id)
        if record is None or record.status not in ACTIVE or record.model != self.model:
            await asyncio.to_thread(self.leases.release, lease)
            return
        job = self.running[lease.job_id] = RunningJob(lease, record)
        renewing = asyncio.get_running_loop().create_task(self._renew(job))
        try:
            await self._run(job)
        except (JobStoreError, OSError) as exc:
            log.error("video job %s: the store failed; its lease expires for another replica: %s", record.id, exc)
        finally:
            renewing.cancel()
            self.running.pop(lease.job_id, None)
            job.done.set()
            if not (job.deleted or job.lost):
                await asyncio.to_thread(self.leases.release, job.lease)
            if not job.backoff:
                self.wake()                                 # room for the next job

    async def _renew(self, job: RunningJob) -> None:
        """Every third of the lease. A store that cannot be reached is tried again while the lease still runs with
        its spare tenth left; then the lease counts as lost, as it soon is for the other replicas."""
        while True:
            await asyncio.sleep(self.config.lease_s / 3)
            try:
                renewed = await asyncio.to_thread(self.leases.renew, job.lease)
            except (OSError, ValueError) as exc:
                log.warning("video job %s: lease not renewed: %s", job.lease.job_id, exc)
                if time.time() < job.lease.expires_at - SPARE * self.config.lease_s:
                    continue
                renewed = None
            if renewed is None:
                if not job.deleted:
                    job.lost = True
                    log.warning("video job %s: lease lost; stopping its run here", job.lease.job_id)
                    self.service.abort([job.lease.job_id])
                return
            job.lease = renewed
            await self._write(job)

    async def _write(self, job: RunningJob, **changes) -> None:
        """Update the record (the owner alone writes it). A deleted job stops its run at the next step. A write the
        store refuses is logged and the run goes on: the lease, not the record, says who runs the job."""
        if job.deleted or job.lost:
            return
        async with job.lock:
            job.record = job.record.model_copy(update={**changes, "lease_expires_at": job.lease.expires_at})
            try:
                await asyncio.to_thread(self.store.put, job.record)
            except JobNotFoundError:
                job.deleted = True
                log.info("video job %s was deleted: stopping it at its next step", job.record.id)
                self.service.abort([job.record.id])
            except JobStoreError as exc:
                log.warning("video job %s: record not written (%s): %s", job.record.id, changes.get("status"), exc)

    def _report(self, job: RunningJob, **changes) -> None:
        """The run's phase and step: written as soon as the last write is done, the latest only (the engine never
        waits for the store, however slow it is)."""
        job.pending = changes
        if job.writer is None or job.writer.done():
            job.writer = asyncio.get_running_loop().create_task(self._flush(job))

    async def _flush(self, job: RunningJob) -> None:
        while job.pending is not None:
            changes, job.pending = job.pending, None
            await self._write(job, **changes)

    async def _settle(self, job: RunningJob) -> None:
        """Progress writes done (dropped when not yet begun): the next write is the last word."""
        job.pending = None
        if job.writer is not None:
            await job.writer

    async def _run(self, job: RunningJob) -> None:
        record = job.record
        if record.attempts >= self.config.max_attempts:
            await self._finish(job, "failed", error=JobError(code="too_many_attempts", message=(
                f"ran {record.attempts} times without finishing (jobs.max_attempts); the last run ended: "
                f"{record.requeued_because or 'with its replica'}")))
            return
        try:
            request = await asyncio.to_thread(self._request, record)
            stream = self.service.submit(request)
        except InvalidRequestError as exc:
            await self._finish(job, "failed", error=JobError(code=exc.error_type, message=str(exc), param=exc.field))
            return
        except DiffStageError as exc:            # the engine cannot take it now (full, draining, dead): not a run
            job.backoff = True
            log.info("video job %s not started here: %s: %s", record.id, type(exc).__name__, exc)
            return
        await self._write(job, status="in_progress", owner=self.owner, attempts=record.attempts + 1,
                          started_at=time.time(), phase=None, step=0, progress=0)
        final = await self._follow(job, stream)
        job.stopped_at = final.step_index
        if job.deleted or job.lost:
            return
        if final.error is None:
            await self._complete(job, final)
        elif final.error_type in REQUEUE_ERRORS or (final.error_type == RequestAbortedError.error_type
                                                    and (self.service.draining or self._closing)):
            await self._requeue(job, final.error)
        else:
            await self._finish(job, "failed", error=JobError(code=final.error_type or "request_failed",
                                                               message=final.error))

    def _request(self, record: JobRecord):
        """(A thread.) The engine request of the job: the stored fields, the stored reference picture."""
        reference = None
        if record.reference:
            reference = decode_image(self.store.read_file(record.id, REFERENCE), "input_reference",
                                     self.service.config.server.max_image_pixels)
        body = VideoJobRequest.stored(record.params)
        return body.video_request(record.id, record.fps, reference, stream=True)

    async def _follow(self, job: RunningJob, stream) -> DiffusionOutput:
        """Consume the request's items to its final one, writing each phase and step into the record."""
        async with aclosing(self.service.outputs(stream)) as items:
            async for item in items:
                if item.finished:
                    await self._settle(job)
                    return item
                steps = item.num_steps or job.record.num_steps
                self._report(job, phase=item.phase, step=item.step_index or 0,
                             progress=progress_of(item.phase, item.step_index or 0, steps))
        await self._settle(job)
        raise EngineDeadError(f"the stream of video job {job.record.id} ended without its final item")

    async def _complete(self, job: RunningJob, final: DiffusionOutput) -> None:
        frames, record = final.images[0], job.record
        await self._write(job, phase="mux", step=final.step_index or record.num_steps,
                          progress=progress_of("mux", record.num_steps, record.num_steps))
        if job.deleted:
            return
        files = await asyncio.to_thread(lambda: {OUTPUTS["video"]: encode_mp4(frames, record.fps),
                                                 OUTPUTS["thumbnail"]: thumbnail_png(frames),
                                                 OUTPUTS["frames"]: frames_zip(frames)})
        try:
            for name, data in files.items():
                await asyncio.to_thread(self.store.write_file, record.id, name, data)
        except JobNotFoundError:
            job.deleted = True
            return
        await self._finish(job, "completed", outputs=tuple(files))

    async def _finish(self, job: RunningJob, status: str, **changes) -> None:
        now = time.time()
        await self._write(job, status=status, phase=None, owner=None, completed_at=now,
                          expires_at=now + self.config.retention_s,
                          progress=100 if status == "completed" else job.record.progress, **changes)
        log.info("video job %s %s (run %d)", job.record.id, status, job.record.attempts)

    async def _requeue(self, job: RunningJob, why: str) -> None:
        """Back in the queue for any replica (from step 0), or failed after ``max_attempts`` runs."""
        if job.record.attempts >= self.config.max_attempts:
            await self._finish(job, "failed", error=JobError(code="too_many_attempts", message=(
                f"ran {job.record.attempts} times without finishing (jobs.max_attempts); the last run ended: {why}")))
            return
        log.info("video job %s back in the queue (%s)", job.record.id, why)
        await self._write(job, status="queued", owner=None, phase=None, step=0, progress=0, started_at=None,
                          requeued_because=why)

    # -- delete and shutdown ---------------------------------------------------------------------------------
    async def cancel(self, job_id: str, timeout: float = CLOSE_WAIT_S) -> dict[str, int] | None:
        """A job deleted from the store that runs here: stop it at its next step and wait until it has stopped.
        Returns {step_at_delete, stopped_at_step} (the steps done when the abort was registered, and when the
        run ended), or None when it does not run here."""
        job = self.running.get(job_id)
        if job is None:
            return None
        job.deleted = True
        at = self.service.abort_counted([job_id]).get(job_id, job.record.step)
        try:
            await asyncio.wait_for(job.done.wait(), timeout)
        except TimeoutError:
            log.error("video job %s still running %g s after its delete", job_id, timeout)
        return {"step_at_delete": at, "stopped_at_step": job.stopped_at if job.stopped_at is not None else at}

    async def close(self) -> None:
        """Stop claiming; wait for the runs (the drain has let them finish or aborted them: those requeue)."""
        self._closing = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self._tasks:
            done, pending = await asyncio.wait(set(self._tasks), timeout=CLOSE_WAIT_S)
            if pending:
                log.error("%d video job run(s) did not end within %g s of the shutdown; their leases expire",
                          len(pending), CLOSE_WAIT_S)
