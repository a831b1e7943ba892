"""A video job run's step checkpoints (part of :class:`stage_runtime.jobs.run.JobRun`).

The engine snapshots the job's step state between two ticks (``checkpoint_request`` with no path: the bytes come
back), after every ``checkpoint_every_steps`` denoising steps and when the replica drains; the job's
:class:`~stage_runtime.jobs.checkpoint_writer.CheckpointWriter` stores it off the step path. The ranks read a
checkpoint to resume from, and write the denoised state before the decode, at a local path: the store's own file on
the folder store, a scratch copy (fetched from the store at the run's start) on the object store.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import tempfile

from stage_runtime.checkpoint import read_manifest
from stage_runtime.errors import DiffStageError, InvalidRequestError, JobNotFoundError, RequestAbortedError
from stage_runtime.jobs.store import CHECKPOINT
from stage_runtime.outputs import DiffusionOutput
from stage_runtime.request import DiffusionRequest

log = logging.getLogger(__name__)
REQUEUE_ERRORS = {"engine_dead", "engine_closed", "stage_unavailable", "queue_full"}   # not the job's fault
CHECKPOINT_TIMEOUT_S = 300.0           # one checkpoint RPC: it waits for the tick in progress, then writes


class RunCheckpoints:
    _scratch: str | None = None            # the object store's local copies of the job's checkpoint

    @property
    def checkpoint_path(self) -> str:
        """Where the ranks read the job's checkpoint and write its denoised state."""
        local = self.store.local_path(self.job_id, CHECKPOINT)
        if local is not None:
            return str(local)
        if self._scratch is None:
            self._scratch = tempfile.mkdtemp(prefix=f"diffstage-{self.job_id}-")
        return os.path.join(self._scratch, CHECKPOINT)

    def _fetch_checkpoint(self) -> None:
        """(A thread.) The job's checkpoint from a store the ranks cannot read directly, to the local path."""
        if self.store.local_path(self.job_id, CHECKPOINT) is not None:
            return
        try:
            data = self.store.read_file(self.job_id, CHECKPOINT)
        except JobNotFoundError:
            return
        with open(self.checkpoint_path, "wb") as out:
            out.write(data)

    def _drop_scratch(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

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

