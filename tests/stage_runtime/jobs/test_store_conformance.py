"""What every job store promises, held against both — the shared folder and an S3 bucket on a real S3 server (moto,
its own process on loopback): a job appears with every file of its create, a create of an id the store holds is
refused and leaves that job whole, a file is replaced whole and read from any offset, ids
list as a key range in creation order both ways, the active jobs list without the finished ones, a deleted job is
gone at once and its writer is told, the sweep expires only the jobs that are due, and of any number of replicas
claiming one job (threads, and processes each with its own client) exactly one holds it; the old owner can no longer
renew, a release frees it at once, a deleted job cannot be claimed."""

from __future__ import annotations

import multiprocessing
import threading
import uuid

import httpx
import pytest
from support.clocks import Clock

from stage_runtime.errors import JobNotFoundError, JobStoreError
from stage_runtime.jobs.lease import Lease
from stage_runtime.jobs.record import JobRecord, new_job_id
from stage_runtime.jobs.store import OUTPUTS, REFERENCE, open_job_store
from stage_runtime.jobs.store.filesystem import FileJobStore
from stage_runtime.jobs.store.s3 import ObjectJobStore

LEASE_S = 30.0


@pytest.fixture(params=["folder", "s3"])
def where(request, tmp_path) -> tuple[str, str | None]:
    """(``--job-store``, endpoint) of a fresh store of each kind."""
    if request.param == "folder":
        return str(tmp_path / "store"), None
    server = request.getfixturevalue("s3_server")
    return f"s3://{server.make_bucket(f'conformance-{uuid.uuid4().hex[:12]}')}/jobs", server.endpoint


@pytest.fixture
def store(where, clock):
    return open_job_store(*where, clock=clock).open()


def make_job(store, now: float, **fields) -> str:
    job = JobRecord(id=new_job_id(now), model="m", prompt="p", params={}, size="16x16", num_frames=9, fps=8,
                    num_steps=2, created_at=now, **fields)
    store.create(job, {REFERENCE: b"reference"})
    return job.id


def test_a_created_job_holds_its_record_and_files_and_its_owner_replaces_the_record(store, clock):
    job = make_job(store, clock.now)
    record = store.get(job)
    assert record.status == "queued" and store.read_file(job, REFERENCE) == b"reference"
    store.put(record.model_copy(update={"status": "in_progress", "step": 1}))
    assert (store.get(job).status, store.get(job).step) == ("in_progress", 1)


def test_a_job_appears_with_every_file_of_its_create_and_an_id_held_is_refused_leaving_the_job_whole(store, clock):
    job = JobRecord(id=new_job_id(clock.now), model="m", prompt="p", params={}, size="16x16", num_frames=9, fps=8,
                    num_steps=2, created_at=clock.now)
    files = {REFERENCE: b"reference", OUTPUTS["video"]: b"mp4", OUTPUTS["thumbnail"]: b"png"}
    store.create(job, files)
    assert store.get(job.id) == job
    assert {name: store.read_file(job.id, name) for name in files} == files
    with pytest.raises(JobStoreError):
        store.create(job.model_copy(update={"prompt": "another"}), {REFERENCE: b"another"})
    assert store.get(job.id) == job and {name: store.read_file(job.id, name) for name in files} == files
    assert store.ids() == store.ids(order="desc") == store.active_ids() == [job.id]


def test_a_file_is_replaced_whole_and_read_from_any_offset(store, clock):
    job = make_job(store, clock.now)
    store.write_file(job, OUTPUTS["video"], b"first version")
    store.write_file(job, OUTPUTS["video"], b"0123456789")
    assert store.read_file(job, OUTPUTS["video"]) == b"0123456789" and store.file_size(job, OUTPUTS["video"]) == 10
    handle = store.open_file(job, OUTPUTS["video"], 4)
    try:
        assert handle.read(3) == b"456" and handle.read(100) == b"789"
    finally:
        handle.close()
    store.remove_file(job, OUTPUTS["video"])
    store.remove_file(job, OUTPUTS["video"])                      # twice: nothing to do
    for missing in (lambda: store.read_file(job, OUTPUTS["video"]), lambda: store.file_size(job, OUTPUTS["video"]),
                    lambda: store.open_file(job, OUTPUTS["video"])):
        with pytest.raises(JobNotFoundError):
            missing()


def test_ids_are_a_key_range_in_creation_order_both_ways(store, clock):
    jobs = [make_job(store, clock.now + i) for i in range(5)]
    assert store.ids() == jobs and store.ids(order="desc") == jobs[::-1]
    assert store.ids(after=jobs[1]) == jobs[2:] and store.ids(after=jobs[1], limit=2) == jobs[2:4]
    assert store.ids(after=jobs[3], order="desc") == jobs[2::-1] and store.ids(limit=2, order="desc") == jobs[:2:-1]
    assert store.ids(after=jobs[4]) == [] and store.ids(after=jobs[0], order="desc") == []
    gone = new_job_id(clock.now + 2.5)                            # an `after` that names no job still pages
    assert store.ids(after=gone) == jobs[3:] and store.ids(after=gone, order="desc") == jobs[2::-1]


def test_the_active_jobs_list_without_the_finished_ones(store, clock):
    jobs = [make_job(store, clock.now + i) for i in range(3)]
    store.put(store.get(jobs[1]).model_copy(update={"status": "completed", "expires_at": clock.now + 100}))
    store.put(store.get(jobs[2]).model_copy(update={"status": "in_progress"}))
    assert store.active_ids() == [jobs[0], jobs[2]]
    assert [r.id for r in store.records()] == jobs


def test_a_deleted_job_is_gone_at_once_and_its_writer_is_told(store, clock):
    kept, job = make_job(store, clock.now), make_job(store, clock.now + 1)
    record = store.get(job)
    trashed = store.delete(job)
    assert trashed is not None and store.get(job) is None and store.delete(job) is None
    with pytest.raises(JobNotFoundError):
        store.put(record.model_copy(update={"step": 2}))
    with pytest.raises(JobNotFoundError):
        store.write_file(job, OUTPUTS["video"], b"late")
    store.purge(trashed)
    assert store.ids() == [kept] and store.active_ids() == [kept] and store.ids(order="desc") == [kept]
    with pytest.raises(JobNotFoundError):
        store.read_file(job, REFERENCE)


def test_the_sweep_expires_only_the_jobs_that_are_due_with_their_files(store, clock):
    due, later, running = (make_job(store, clock.now + i) for i in range(3))
    for job, expires in ((due, clock.now + 10), (later, clock.now + 1000)):
        store.write_file(job, OUTPUTS["video"], b"mp4")
        store.put(store.get(job).model_copy(update={"status": "completed", "expires_at": expires}))
    clock.now += 11
    assert store.sweep() == [due] and store.sweep() == []
    assert store.get(due) is None and store.ids() == [later, running]
    with pytest.raises(JobNotFoundError):
        store.read_file(due, OUTPUTS["video"])
    assert store.read_file(later, OUTPUTS["video"]) == b"mp4"


@pytest.mark.parametrize("job_id", ["../etc", "video_", "video_" + "g" * 32, ""])
def test_an_id_that_is_not_a_job_id_is_not_found(store, job_id):
    assert store.get(job_id) is None
    with pytest.raises(JobNotFoundError):
        store.read_file(job_id, REFERENCE)


def test_a_file_has_a_presigned_url_on_the_object_store_and_a_local_path_on_the_folder(store, clock):
    job = make_job(store, clock.now)
    store.write_file(job, OUTPUTS["video"], b"an mp4")
    url = store.presign(job, OUTPUTS["video"], 60, f"{job}.mp4", "video/mp4")
    local = store.local_path(job, OUTPUTS["video"])
    if isinstance(store, ObjectJobStore):
        fetched = httpx.get(url)
        assert fetched.status_code == 200 and fetched.content == b"an mp4" and local is None
        assert fetched.headers["content-type"] == "video/mp4" and f'filename="{job}.mp4"' in \
            fetched.headers["content-disposition"]
    else:
        assert url is None and local.read_bytes() == b"an mp4"


# -- leases ----------------------------------------------------------------------------------------------------------
def test_a_live_lease_keeps_others_out_and_its_owner_renews_it(store, clock):
    job = make_job(store, clock.now)
    a, b = store.leases("a", LEASE_S), store.leases("b", LEASE_S)
    lease = a.claim(job)
    assert lease is not None and (lease.generation, lease.owner, lease.expires_at) == (1, "a", clock.now + LEASE_S)
    assert b.claim(job) is None and not b.free(job)
    clock.now += LEASE_S / 3
    renewed = a.renew(lease)
    assert renewed.expires_at == clock.now + LEASE_S and b.current(job) == renewed
    clock.now += LEASE_S * 0.8                      # past the first lease's end: the renewal kept it
    assert b.claim(job) is None and a.holds(renewed)


def test_an_owner_that_stops_renewing_loses_the_job_and_cannot_renew_after(store, clock):
    job = make_job(store, clock.now)
    a, b = store.leases("a", LEASE_S), store.leases("b", LEASE_S)
    old = a.claim(job)
    clock.now += LEASE_S * 0.95                     # inside the lease, but within its last tenth: no renewal
    assert a.renew(old) is None and b.claim(job) is None
    clock.now += LEASE_S * 0.05
    taken = b.claim(job)
    assert taken is not None and taken.generation == 2 and taken.owner == "b"
    assert a.renew(old) is None and not a.holds(old) and b.holds(taken)
    a.release(old)                                  # a lost lease's release changes nothing
    assert b.current(job) == taken


def test_a_renewal_after_another_replica_took_the_job_loses_it(store, clock):
    """Its clock behind (or its loop stalled), the old owner still thinks its lease runs: the store says no."""
    job = make_job(store, clock.now)
    old = store.leases("a", LEASE_S).claim(job)
    taken = open_store_like(store, Clock(clock.now + LEASE_S + 1)).leases("b", LEASE_S).claim(job)
    assert taken is not None and taken.generation == 2
    assert store.leases("a", LEASE_S).renew(old) is None and store.leases("b", LEASE_S).current(job) == taken


def open_store_like(store, clock):
    """The same store seen by another replica whose clock is ``clock``."""
    if isinstance(store, ObjectJobStore):
        return ObjectJobStore(store.bucket, store.prefix, store.endpoint, clock=clock)
    return FileJobStore(store.root, clock)


def test_a_released_job_is_free_at_once(store, clock):
    job = make_job(store, clock.now)
    a, b = store.leases("a", LEASE_S), store.leases("b", LEASE_S)
    a.release(a.claim(job))
    assert b.free(job) and b.claim(job).generation == 2


def test_a_deleted_job_cannot_be_claimed_nor_renewed(store, clock):
    job = make_job(store, clock.now)
    a = store.leases("a", LEASE_S)
    lease = a.claim(job)
    store.purge(store.delete(job))
    assert a.renew(lease) is None and a.claim(job) is None and a.current(job) is None


def expire(store, job: str, clock: Clock) -> Lease:
    """``job`` claimed by a replica that then stopped renewing: its lease ran out a moment ago."""
    lease = open_store_like(store, Clock(clock.now - LEASE_S - 1)).leases("dead", LEASE_S).claim(job)
    assert lease is not None and lease.expires_at < clock.now
    return lease


def test_threads_released_together_on_one_expired_lease_make_exactly_one_owner(store, clock):
    claimers = 8
    for round_ in range(10):
        job = make_job(store, clock.now + round_)
        expire(store, job, clock)
        start, won = threading.Barrier(claimers), []

        def claim(name: str) -> None:
            leases = store.leases(name, LEASE_S)
            start.wait()
            lease = leases.claim(job)
            if lease is not None:
                won.append(lease)

        threads = [threading.Thread(target=claim, args=(f"r{i}",)) for i in range(claimers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(won) == 1, f"round {round_}: {won}"
        assert won[0].generation == 2 and store.leases("x", LEASE_S).current(job) == won[0]


def claim_all(where: tuple[str, str | None], name: str, jobs: list[str], now: float, start, results) -> None:
    """One replica process with its own client: released with the others, it tries to claim every job in turn."""
    leases = open_job_store(*where, clock=Clock(now)).leases(name, LEASE_S)
    start.wait()
    results.put((name, [job for job in jobs if leases.claim(job) is not None]))


def test_processes_released_together_on_expired_leases_each_job_has_one_owner(store, where, clock):
    jobs = [make_job(store, clock.now + i) for i in range(12)]
    for job in jobs:
        expire(store, job, clock)
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(3), context.Queue()
    procs = [context.Process(target=claim_all, args=(where, f"p{i}", jobs, clock.now, start, results))
             for i in range(3)]
    for proc in procs:
        proc.start()
    won = dict(results.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    owners = {job: [name for name, mine in won.items() if job in mine] for job in jobs}
    assert all(len(names) == 1 for names in owners.values()), owners
    reader = store.leases("x", LEASE_S)
    assert all(reader.current(job).owner == names[0] for job, names in owners.items())
