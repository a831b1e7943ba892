"""One runner per job: a live lease keeps other replicas out, an expired one is taken by exactly one of any number
of claimers (threads and processes released together), the old owner can no longer renew, a release frees the
job at once, a deleted job cannot be claimed."""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path

import pytest
from support.clocks import Clock

from stage_runtime.jobs.lease import Lease
from stage_runtime.jobs.store.file_leases import FileLeases
from stage_runtime.jobs.record import JobRecord, new_job_id
from stage_runtime.jobs.store.filesystem import FileJobStore

LEASE_S = 30.0


def make_job(store: FileJobStore, now: float) -> str:
    job = JobRecord(id=new_job_id(now), model="m", prompt="p", params={}, size="16x16", num_frames=9, fps=8,
                    num_steps=2, created_at=now)
    store.create(job)
    return job.id


def test_a_live_lease_keeps_others_out_and_its_owner_renews_it(store, clock):
    job = make_job(store, clock.now)
    a, b = FileLeases(store, "a", LEASE_S, clock), FileLeases(store, "b", LEASE_S, clock)
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
    a, b = FileLeases(store, "a", LEASE_S, clock), FileLeases(store, "b", LEASE_S, clock)
    old = a.claim(job)
    clock.now += LEASE_S * 0.95                     # inside the lease, but within its last tenth: no renewal
    assert a.renew(old) is None and b.claim(job) is None
    clock.now += LEASE_S * 0.05
    taken = b.claim(job)
    assert taken is not None and taken.generation == 2 and taken.owner == "b"
    assert a.renew(old) is None and not a.holds(old) and b.holds(taken)
    a.release(old)                                  # a lost lease's release changes nothing
    assert b.current(job) == taken


def test_a_released_job_is_free_at_once(store, clock):
    job = make_job(store, clock.now)
    a, b = FileLeases(store, "a", LEASE_S, clock), FileLeases(store, "b", LEASE_S, clock)
    a.release(a.claim(job))
    assert b.free(job) and b.claim(job).generation == 2


def test_a_deleted_job_cannot_be_claimed_nor_renewed(store, clock):
    job = make_job(store, clock.now)
    a = FileLeases(store, "a", LEASE_S, clock)
    lease = a.claim(job)
    store.purge(store.delete(job))
    assert a.renew(lease) is None and a.claim(job) is None and a.current(job) is None
    assert not (store.root / "jobs" / job).exists()


def expire(store: FileJobStore, job: str, clock: Clock) -> Lease:
    """``job`` claimed by a replica that then stopped renewing: its lease ran out a moment ago."""
    lease = FileLeases(store, "dead", LEASE_S, Clock(clock.now - LEASE_S - 1)).claim(job)
    assert lease is not None and lease.expires_at < clock.now
    return lease


def test_threads_released_together_on_one_expired_lease_make_exactly_one_owner(store, clock):
    claimers = 8
    for round_ in range(25):
        job = make_job(store, clock.now + round_)
        expire(store, job, clock)
        start, won = threading.Barrier(claimers), []

        def claim(name: str) -> None:
            leases = FileLeases(store, name, LEASE_S, clock)
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
        assert won[0].generation == 2 and FileLeases(store, "x", LEASE_S, clock).current(job) == won[0]


def claim_all(root: str, name: str, jobs: list[str], now: float, start, results) -> None:
    """One replica process: released with the others, it tries to claim every job in turn."""
    leases = FileLeases(FileJobStore(Path(root)), name, LEASE_S, Clock(now))
    start.wait()
    results.put((name, [job for job in jobs if leases.claim(job) is not None]))


def test_processes_released_together_on_expired_leases_each_job_has_one_owner(store, clock):
    jobs = [make_job(store, clock.now + i) for i in range(20)]
    for job in jobs:
        expire(store, job, clock)
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(4), context.Queue()
    procs = [context.Process(target=claim_all, args=(str(store.root), f"p{i}", jobs, clock.now, start, results))
             for i in range(4)]
    for proc in procs:
        proc.start()
    won = dict(results.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    owners = {job: [name for name, mine in won.items() if job in mine] for job in jobs}
    assert all(len(names) == 1 for names in owners.values()), owners
    reader = FileLeases(store, "x", LEASE_S, clock)
    assert all(reader.current(job).owner == names[0] for job, names in owners.items())
