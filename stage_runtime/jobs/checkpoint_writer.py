"""One video job's checkpoint writes, off the engine's step path (``jobs.run``).

The engine only snapshots the job's step state between two ticks (``checkpoint_request`` with no path: the file's
bytes come back); this writer stores them in a thread, at most one write in flight. A snapshot taken while one is
written waits as the pending one, and a newer snapshot replaces it (only the newest is worth writing). ``flush``
waits for the last write: a job's final state, and a hand-off, come after it. A write that fails is logged; the
next snapshot tries again, and with none newer the same one is tried again every ``retry_s`` while ``retry_while()``
holds (the run's lease still runs: a store out of reach for a while gets the checkpoint once it is back). The job's
older checkpoint, if any, stays whole meanwhile: writes replace the file atomically.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from stage_runtime.errors import JobNotFoundError

log = logging.getLogger(__name__)


class CheckpointWriter:
    def __init__(self, job_id: str, write: Callable[[bytes], None], on_written: Callable[[int], None] = lambda s: None,
                 retry_while: Callable[[], bool] = lambda: False, retry_s: float = 1.0):
        self.job_id = job_id
        self._retry_while, self._retry_s = retry_while, retry_s
        self._write = write                       # (a thread) the bytes to the job's checkpoint, whole or not at all
        self._on_written = on_written             # the step now durable
        self._pending: tuple[int, bytes] | None = None
        self._task: asyncio.Task | None = None
        self.written_step: int | None = None      # the step of the newest checkpoint written
        self.replaced = 0                         # snapshots dropped for a newer one before their write began
        self.retries = 0                          # writes tried again after the store failed one
        self.fenced = False                       # the run lost its lease: no more writes
        self.write_seconds: list[float] = []

    def fence(self) -> None:
        """The run lost its lease: nothing more is written (a pending snapshot is dropped; a write already under way
        in its thread cannot be recalled — it holds a valid state of the same job, which the new owner's next
        checkpoint replaces)."""
        self.fenced = True
        self._pending = None

    def submit(self, step: int, data: bytes) -> None:
        if self.fenced:
            return
        if self._pending is not None:
            self.replaced += 1
        self._pending = (step, data)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        while self._pending is not None and not self.fenced:
            (step, data), self._pending = self._pending, None
            started = time.perf_counter()
            try:
                await asyncio.to_thread(self._write, data)
            except JobNotFoundError:               # the job was deleted: nothing to keep
                self._pending = None
                return
            except OSError as exc:                 # JobStoreError too: the store refused it; the next one may land
                log.warning("video job %s: checkpoint of step %d not written: %s", self.job_id, step, exc)
                if self._pending is None and self._retry_while():
                    self.retries += 1
                    self._pending = (step, data)
                    await asyncio.sleep(self._retry_s)
                continue
            self.write_seconds.append(time.perf_counter() - started)
            self.written_step = step
            self._on_written(step)

    async def flush(self) -> int | None:
        """Every submitted snapshot written (or failed): the newest step written."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)
        return self.written_step

    @property
    def busy(self) -> bool:
        return self._task is not None and not self._task.done()
