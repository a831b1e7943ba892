"""Which jobs of the shared store this replica runs (docs/http-api.md "Video jobs"); each run is a
``jobs.run.JobRun``.

Every ``scan_interval_s`` (and at once after a create here or a run here ending) the runner sweeps expired jobs
and, while the stage is ready, claims the oldest claimable jobs of its model — queued ones, and in-progress ones
whose owner stopped renewing its lease — until it runs ``max_num_seqs`` of them. A DELETE that reaches this
replica stops a run here at once (:meth:`JobRunner.cancel`). When the replica drains, the runner stops claiming
and hands every run off (:meth:`JobRunner.hand_off`: each checkpoints, stops and goes back in the queue with its
lease released, for another replica to resume) before the drain waits for the other requests; on shutdown it waits
for what is left of its runs. A run that lost its lease (its renewals failed for longer than the lease allows) stopped
without writing; the replica is then *fenced*: it claims nothing until a store round trip is clean again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

from stage_runtime.config import JobsConfig
from stage_runtime.jobs.lease import SPARE, Lease
from stage_runtime.jobs.record import ACTIVE, STATUSES
from stage_runtime.jobs.store import JobStore
from stage_runtime.jobs.run import JobRun
from stage_runtime.serve.service import StageService

log = logging.getLogger(__name__)
CLOSE_WAIT_S = 30.0
FINISHED_COUNT_S = 30.0        # the finished jobs are counted (every record read) at most this often


def replica_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class JobRunner:
    def __init__(self, service: StageService, store: JobStore, config: JobsConfig, model: str,
                 owner: str | None = None):
        self.service, self.store, self.config, self.model = service, store, config, model
        self.owner = owner or replica_name()
        self.leases = store.leases(self.owner, config.lease_s)
        self.running: dict[str, JobRun] = {}
        self.counts: dict[str, int] = dict.fromkeys(STATUSES, 0)       # the model's jobs by status, at the last scan
        self._finished: dict[str, int] = {}                             # completed, failed: counted less often
        self._finished_counted_at = float("-inf")
        self._active: set[str] = set()                                 # the active ids at the last scan
        self._tasks: set[asyncio.Task] = set()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._closing = False
        # a run here lost its lease (its renewals failed: the store out of reach for a lease, this process stalled):
        # the replica claims nothing until a store round trip is clean again (see _unfence)
        self.fenced: str | None = None

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._scan_loop())

    def wake(self) -> None:
        self._wake.set()

    @property
    def capacity(self) -> int:
        return self.service.config.scheduler.max_num_seqs

    # -- the scan loop --------------------------------------------------------------------------------------
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
        if self.fenced is not None:
            await asyncio.to_thread(self._unfence)
        taking = not self._closing and self.service.state == "ready" and self.fenced is None
        room = max(0, self.capacity - len(self._tasks)) if taking else 0
        for lease in await asyncio.to_thread(self._claim, room):
            task = asyncio.get_running_loop().create_task(self._own(lease))
            self._tasks.add(task)
            task.add_done_callback(self._ended)

    def _claim(self, room: int) -> list[Lease]:
        """(A thread.) Up to ``room`` leases on the oldest claimable jobs of this model; the model's jobs counted
        by status on the way (``counts``): the active ones at every scan (the store lists them without reading the
        finished ones), the finished ones when a job left the active ones since the last scan (it finished, or was
        deleted) and every ``FINISHED_COUNT_S`` at least."""
        claimed, now = [], self.store.clock()
        counts = dict.fromkeys(ACTIVE, 0)
        active = self.store.active_ids()
        if now - self._finished_counted_at >= FINISHED_COUNT_S or not self._active.issubset(active):
            finished = dict.fromkeys((s for s in STATUSES if s not in ACTIVE), 0)
            for record in self.store.records():
                if record.model == self.model and record.status in finished and not record.expired(now):
                    finished[record.status] += 1
            self._finished, self._finished_counted_at = finished, now
        counts.update(self._finished)
        self._active = set(active)
        for job_id in active:
            record = self.store.get(job_id)
            if record is None or record.model != self.model or record.expired(now) or record.status not in ACTIVE:
                continue
            counts[record.status] += 1
            if len(claimed) >= room or record.status not in ACTIVE or record.id in self.running:
                continue
            lease = self.leases.claim(record.id)
            if lease is not None:
                claimed.append(lease)
        self.counts = counts
        return claimed

    def _unfence(self) -> None:
        """(A thread.) Claims resume once a store round trip (a one-id listing) takes less than the lease's spare
        tenth: the spare a renewal needs to land before its lease could be claimed by another replica."""
        started = time.monotonic()
        try:
            self.store.ids(limit=1)
        except OSError as exc:
            log.info("still fenced (%s): the store: %s", self.fenced, exc)
            return
        took = time.monotonic() - started
        if took < SPARE * self.config.lease_s:
            log.warning("claiming again: a store round trip took %.3f s (fenced since: %s)", took, self.fenced)
            self.fenced = None
        else:
            log.info("still fenced (%s): a store round trip took %.3f s", self.fenced, took)

    def stats(self) -> dict[str, int]:
        """``jobs`` in ``/v1/stats``: the runs on this replica (``here``: they hand off when it drains) and the
        model's jobs in the store by status, as of the last scan (every replica sees the same store)."""
        return {"here": len(self.running), **self.counts}

    async def _own(self, lease: Lease) -> None:
        record = await asyncio.to_thread(self.store.get, lease.job_id)
        if record is None or record.status not in ACTIVE or record.model != self.model or self._closing:
            await asyncio.to_thread(self.leases.release, lease)
            return
        run = self.running[lease.job_id] = JobRun(self.service, self.store, self.leases, self.config, lease, record,
                                                  lambda: self._closing)
        try:
            await run.run()
        finally:
            self.running.pop(lease.job_id, None)
            if run.lost:
                self.fenced = f"the lease of {lease.job_id} was lost"
                log.warning("fenced: %s; claiming nothing until the store answers cleanly", self.fenced)
            if not run.backoff:
                self.wake()                                 # room for the next job

    def _ended(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("a video job run failed", exc_info=task.exception())

    # -- delete and shutdown ---------------------------------------------------------------------------------
    async def cancel(self, job_id: str, timeout: float = CLOSE_WAIT_S) -> dict[str, int] | None:
        """A job deleted from the store: when it runs here, stop it at its next step and wait until it has
        stopped ({step_at_delete, stopped_at_step}); None when it does not run here."""
        run = self.running.get(job_id)
        return None if run is None else await run.cancel(timeout)

    async def hand_off(self, timeout: float = CLOSE_WAIT_S) -> list[str]:
        """The replica drains: stop claiming; every run here checkpoints, stops and puts its job back in the queue at
        that step with its lease released. Returns the ids handed off."""
        self._closing = True
        runs = list(self.running.values())
        for run, outcome in zip(runs, await asyncio.gather(*(run.hand_off(timeout) for run in runs),
                                                           return_exceptions=True), strict=True):
            if isinstance(outcome, BaseException):
                log.error("video job %s: hand-off failed", run.job_id, exc_info=outcome)
        if runs:
            log.info("handed off %d video job(s) at the drain: %s", len(runs), ", ".join(r.job_id for r in runs))
        return [run.job_id for run in runs]

    async def close(self) -> None:
        """Stop claiming; wait for the runs (the drain has let them finish or aborted them: those requeue)."""
        self._closing = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=CLOSE_WAIT_S)
            if pending:
                log.error("%d video job run(s) did not end within %g s of the shutdown; their leases expire",
                          len(pending), CLOSE_WAIT_S)
