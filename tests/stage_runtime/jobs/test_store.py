"""The job store on a folder: a job appears and disappears whole (one rename), records are replaced atomically,
ids list in creation order, a deleted job refuses writes, expiry removes record and files together."""

from __future__ import annotations

import os
import threading

import pytest

from stage_runtime.errors import JobNotFoundError, JobStoreError
from stage_runtime.jobs.record import JobRecord, new_job_id
from stage_runtime.jobs.store.filesystem import FileJobStore
from stage_runtime.jobs.store import OUTPUTS, RECORD, REFERENCE


def record(now: float, **fields) -> JobRecord:
    return JobRecord(id=new_job_id(now), model="tiny-wan", prompt="a fox", params={"prompt": "a fox", "seed": 1},
                     size="16x16", num_frames=9, fps=8, num_steps=3, created_at=now, **fields)


def test_a_created_job_is_one_folder_with_its_record_and_inputs_and_nothing_left_in_incoming(store, clock):
    job = record(clock.now, reference=True)
    store.create(job, {REFERENCE: b"png bytes"})
    folder = store.root / "jobs" / job.id
    assert sorted(os.listdir(folder)) == sorted([RECORD, REFERENCE])
    assert store.get(job.id) == job and store.read_file(job.id, REFERENCE) == b"png bytes"
    assert os.listdir(store.root / "incoming") == [] and os.listdir(store.root / "trash") == []


def test_a_reader_never_sees_part_of_a_record_while_its_owner_replaces_it(store, clock):
    job = record(clock.now)
    store.create(job)
    stop, replaced, seen = threading.Event(), threading.Event(), []

    def writer() -> None:
        step = 0
        while not stop.is_set():
            step += 1
            store.put(job.model_copy(update={"step": step, "prompt": "x" * (step % 5000)}))
            if step == 50:
                replaced.set()

    thread = threading.Thread(target=writer)
    thread.start()
    try:      # reads overlap at least 50 replacements, however the threads are scheduled
        while len(seen) < 300 or not replaced.is_set():
            seen.append(store.get(job.id).step)        # a torn file would raise JobStoreError here
    finally:
        stop.set()
        thread.join()
    assert seen == sorted(seen) and seen[-1] > 0
    assert [name for name in os.listdir(store.root / "jobs" / job.id) if name != RECORD] == []


def test_ids_list_in_creation_order_and_records_skip_a_deleted_job(store, clock):
    made = []
    for offset in (0.0, 0.001, 0.5, 7.0):
        made.append(record(clock.now + offset))
        store.create(made[-1])
    assert store.ids() == [job.id for job in made]
    store.delete(made[1].id)
    assert [r.id for r in store.records()] == [made[0].id, made[2].id, made[3].id]


def test_a_deleted_job_is_gone_at_once_and_its_writer_is_told(store, clock):
    job = record(clock.now)
    store.create(job, {REFERENCE: b"png"})
    trashed = store.delete(job.id)
    assert store.get(job.id) is None and not (store.root / "jobs" / job.id).exists()
    with pytest.raises(JobNotFoundError, match="deleted"):
        store.put(job.model_copy(update={"step": 2}))
    with pytest.raises(JobNotFoundError, match="deleted"):
        store.write_file(job.id, OUTPUTS["video"], b"mp4")
    assert not (store.root / "jobs" / job.id).exists()            # no write brought the folder back
    store.purge(trashed)
    assert os.listdir(store.root / "trash") == [] and store.delete(job.id) is None


def test_expiry_removes_the_record_and_every_file_together(store, clock):
    done = record(clock.now, status="completed", completed_at=clock.now, expires_at=clock.now + 60,
                  outputs=tuple(OUTPUTS.values()))
    queued, failed = record(clock.now + 1), record(clock.now + 2, status="failed", expires_at=clock.now + 600)
    store.create(done, {name: b"data" for name in OUTPUTS.values()})
    store.create(queued)
    store.create(failed)
    assert store.sweep() == [] and len(store.ids()) == 3
    clock.now += 60
    assert store.get(done.id).expired(clock.now)
    assert store.sweep() == [done.id]
    assert store.get(done.id) is None and not (store.root / "jobs" / done.id).exists()
    assert os.listdir(store.root / "trash") == []                  # the files went with the record
    assert store.ids() == [queued.id, failed.id]
    clock.now += 10_000
    assert store.sweep() == [failed.id] and store.ids() == [queued.id]   # a queued job never expires


@pytest.mark.parametrize("job_id", ["../../etc", "video_123", "video_" + "g" * 32, ""])
def test_an_id_that_is_not_a_job_id_is_not_found_and_never_a_path(store, job_id):
    assert store.get(job_id) is None and store.delete(job_id) is None
    with pytest.raises(JobNotFoundError, match="video_<32 hex digits>"):
        store.folder(job_id)


def test_a_store_that_is_not_a_writable_folder_is_named(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(JobStoreError, match=r"job store '.*file/store' is not a writable folder"):
        FileJobStore(tmp_path / "file" / "store").open()


def test_an_unreadable_record_is_named_and_listing_skips_it(store, clock):
    good, bad = record(clock.now), record(clock.now + 1)
    store.create(good)
    store.create(bad)
    (store.root / "jobs" / bad.id / RECORD).write_text("{not json")
    with pytest.raises(JobStoreError, match=f"cannot read .*{bad.id}/{RECORD}"):
        store.get(bad.id)
    assert [r.id for r in store.records()] == [good.id]
