"""A job's checkpoint writer (jobs.checkpoint_writer): one write in flight, the newest pending snapshot replacing an
older one, flush waiting for the last write, a failed write logged and the next one tried, a deleted job's writes
dropped."""

from __future__ import annotations

import asyncio
import threading

from stage_runtime.errors import JobNotFoundError, JobStoreError
from stage_runtime.jobs.checkpoint_writer import CheckpointWriter


async def test_one_write_in_flight_the_newest_pending_replaces_older_ones_and_flush_waits():
    gate, written = threading.Event(), []

    def write(data: bytes) -> None:
        gate.wait(10)                                   # the first write holds until the test releases it
        written.append(data)

    noted = []
    writer = CheckpointWriter("job", write, on_written=noted.append)
    for step in (1, 2, 3, 4):
        writer.submit(step, f"s{step}".encode())
        await asyncio.sleep(0)
    assert writer.busy and writer.replaced == 2         # 1 in flight; 2 and 3 replaced by 4
    gate.set()
    assert await writer.flush() == 4
    assert written == [b"s1", b"s4"] and noted == [1, 4] and not writer.busy


async def test_a_failed_write_is_logged_and_the_next_snapshot_is_written(caplog):
    attempts = []

    def write(data: bytes) -> None:
        attempts.append(data)
        if data == b"bad":
            raise JobStoreError("the store is away")

    writer = CheckpointWriter("job", write)
    writer.submit(5, b"bad")
    assert await writer.flush() is None and "checkpoint of step 5 not written" in caplog.text
    writer.submit(6, b"good")
    assert await writer.flush() == 6 and attempts == [b"bad", b"good"]


async def test_a_deleted_jobs_pending_writes_are_dropped():
    gate, attempts = threading.Event(), []

    def write(data: bytes) -> None:
        attempts.append(data)
        gate.wait(10)
        raise JobNotFoundError("video job job was deleted")

    writer = CheckpointWriter("job", write)
    writer.submit(1, b"a")
    await asyncio.sleep(0)
    writer.submit(2, b"b")                              # pending behind the write that finds the job gone
    gate.set()
    assert await writer.flush() is None and attempts == [b"a"]
