"""What only the object store has to get right (the promises both stores keep are test_store_conformance.py's), on
a real S3 server process (moto): a write whose answer was lost — it landed, and botocore's retry got 412 or timed out —
is told by its content (a create counts, a claim or a renewal holds); a create whose record was refused leaves
nothing, one that cannot tell leaves its objects to the sweep's full pass, which removes them once an hour old with
the stale markers; a store out of reach (paused, stopped) or a missing bucket fails within seconds, named."""

from __future__ import annotations

import time
import uuid

import pytest
from botocore.exceptions import ReadTimeoutError
from support.clocks import Clock
from support.s3_server import free_port

from stage_runtime.errors import JobStoreError
from stage_runtime.jobs.record import JobRecord, new_job_id
from stage_runtime.jobs.store import RECORD, REFERENCE
from stage_runtime.jobs.store.s3 import ObjectJobStore
from stage_runtime.jobs.store.s3_client import make_client
from stage_runtime.jobs.store.s3_leases import LEASE
from stage_runtime.jobs.store.s3_sweep import LEFTOVER_AGE_S, sweep_leftovers

LEASE_S = 30.0


def landed_then_retried(client, params):
    """The write lands, its answer is lost, botocore sends it again: a conditional one meets itself (412)."""
    client.put_object(**params)
    return client.put_object(**params)


def landed_then_timed_out(client, params):
    client.put_object(**params)
    raise ReadTimeoutError(endpoint_url="http://the-store")


def timed_out(client, params):
    raise ReadTimeoutError(endpoint_url="http://the-store")


class Faulty:
    """A boto3 client whose next writes (and, with ``reads_fail``, reads) of keys ending in ``name`` go wrong as
    ``faults`` say; every other call passes through."""

    def __init__(self, client, name: str, *faults, reads_fail: bool = False):
        self.client, self.name, self.faults, self.reads_fail = client, name, list(faults), reads_fail

    def __getattr__(self, method: str):
        return getattr(self.client, method)

    def put_object(self, **params):
        if params["Key"].endswith(self.name) and self.faults:
            return self.faults.pop(0)(self.client, params)
        return self.client.put_object(**params)

    def get_object(self, **params):
        if self.reads_fail and params["Key"].endswith(self.name):
            raise ReadTimeoutError(endpoint_url="http://the-store")
        return self.client.get_object(**params)


@pytest.fixture
def bucket(s3_server) -> str:
    return s3_server.make_bucket(f"s3-only-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def store_with(s3_server, bucket, clock):
    """``store_with(name, *faults)``: the store on this test's bucket through a Faulty client."""
    def make(name: str = "", *faults, reads_fail: bool = False) -> ObjectJobStore:
        client = Faulty(make_client(s3_server.endpoint, None), name, *faults, reads_fail=reads_fail)
        return ObjectJobStore(bucket, "jobs", s3_server.endpoint, clock=clock, client=client).open()
    return make


def job_record(now: float) -> JobRecord:
    return JobRecord(id=new_job_id(now), model="m", prompt="p", params={}, size="16x16", num_frames=9, fps=8,
                     num_steps=2, created_at=now)


def every_key(s3_server, bucket: str) -> list[str]:
    return [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=bucket).get("Contents", ())]


@pytest.mark.parametrize("fault", [landed_then_retried, landed_then_timed_out])
def test_a_record_write_whose_answer_was_lost_counts_as_created(store_with, clock, fault):
    store, job = store_with(RECORD, fault), job_record(clock.now)
    store.create(job, {REFERENCE: b"png"})
    assert store.get(job.id) == job and store.read_file(job.id, REFERENCE) == b"png"
    assert store.ids() == store.ids(order="desc") == store.active_ids() == [job.id]


def test_a_create_whose_record_write_failed_leaves_nothing(store_with, clock, s3_server, bucket):
    store, job = store_with(RECORD, timed_out), job_record(clock.now)
    with pytest.raises(JobStoreError, match="Read timeout"):
        store.create(job, {REFERENCE: b"png"})
    assert store.get(job.id) is None and store.ids() == store.ids(order="desc") == store.active_ids() == []
    assert every_key(s3_server, bucket) == []


def test_a_create_that_cannot_tell_leaves_its_objects_to_the_sweep_which_removes_them_an_hour_on(
        store_with, s3_server, bucket):
    clock = Clock(time.time())                       # the objects' LastModified is the server's real time
    store, kept = store_with(), job_record(clock.now)
    store.create(kept, {REFERENCE: b"kept"})
    cut = job_record(clock.now + 1)
    written_from = time.time()
    with pytest.raises(JobStoreError):
        store_with(RECORD, timed_out, reads_fail=True).create(cut, {REFERENCE: b"cut"})
    written_by = time.time()
    assert store.get(cut.id) is None
    assert len(every_key(s3_server, bucket)) == 4 + 3                                   # the cut job's file, 2 markers
    sweep_leftovers(store, written_from + LEFTOVER_AGE_S - 2)                            # a create in progress?
    assert len(every_key(s3_server, bucket)) == 4 + 3
    sweep_leftovers(store, written_by + LEFTOVER_AGE_S + 1)
    assert store.ids() == store.ids(order="desc") == store.active_ids() == [kept.id]
    assert sorted(every_key(s3_server, bucket)) == sorted(
        [store.key(kept.id, RECORD), store.key(kept.id, REFERENCE), store.newest_key(kept.id),
         store.active_key(kept.id)])


def test_the_full_pass_drops_the_active_marker_of_a_finished_job_and_the_sweep_a_moved_expiry(store_with, clock,
                                                                                             s3_server, bucket):
    store, job = store_with(), job_record(clock.now)
    store.create(job)
    done = job.model_copy(update={"status": "completed", "expires_at": clock.now + 10})
    store.put(done)
    store.objects.write(store.active_key(job.id), b"")            # a put whose marker removal failed
    assert store.active_ids() == [job.id]
    later = done.model_copy(update={"expires_at": clock.now + 500})
    store.put(later)                                               # its first expiry marker now says nothing
    clock.now += 20
    store.leftovers_at = clock.now - 3600
    assert store.sweep() == [] and store.active_ids() == [] and store.get(job.id) == later
    assert [k for k in every_key(s3_server, bucket) if "/expiry/" in k] == [store.expiry_key(later)]


def test_a_lease_write_whose_answer_was_lost_is_held_by_its_writer_alone(store_with, clock):
    store = store_with(LEASE, landed_then_retried, landed_then_timed_out, landed_then_retried)
    job = job_record(clock.now)
    store.create(job)
    a, b = store.leases("a", LEASE_S), store.leases("b", LEASE_S)
    lease = a.claim(job.id)                                        # If-None-Match: it landed, its retry got 412
    assert lease is not None and a.holds(lease) and b.claim(job.id) is None
    clock.now += LEASE_S / 3
    with pytest.raises(JobStoreError):                             # the store stalled: the run tries again soon
        a.renew(lease)
    assert not a.holds(lease) and b.current(job.id).expires_at == clock.now + LEASE_S     # it landed unseen
    clock.now += 1
    renewed = a.renew(lease)                                       # on the stale ETag: 412, then its own claim seen
    assert renewed is not None and renewed.expires_at == clock.now + LEASE_S and a.holds(renewed)
    clock.now += LEASE_S / 3
    renewed = a.renew(renewed)                                     # landed, its retry got 412: its very content
    assert renewed is not None and a.holds(renewed) and b.current(job.id) == renewed
    a.release(renewed)
    taken = b.claim(job.id)
    assert taken is not None and taken.generation == 2 and a.renew(renewed) is None and a.holds(renewed) is False


def test_an_object_store_out_of_reach_fails_within_seconds_naming_it(s3_server, clock):
    store = ObjectJobStore.from_url(f"s3://{s3_server.make_bucket('out-of-reach')}/x", endpoint=s3_server.endpoint,
                                    clock=clock).open()
    job = job_record(clock.now)
    store.create(job)
    s3_server.pause()
    try:
        started = time.monotonic()
        with pytest.raises(JobStoreError) as refused:
            store.get(job.id)
        assert "s3://out-of-reach/x/" in str(refused.value) and s3_server.endpoint in str(refused.value)
        assert time.monotonic() - started < 20
    finally:
        s3_server.resume()
    assert store.get(job.id) == job                                # back, with everything it held


def test_a_stopped_object_store_fails_at_once_naming_it(clock):
    endpoint = f"http://127.0.0.1:{free_port()}"                   # nothing listens there: a server stopped
    store = ObjectJobStore.from_url("s3://stopped/x", endpoint=endpoint, clock=clock)
    started = time.monotonic()
    for call in (store.open, lambda: store.get(new_job_id(clock.now)), store.ids):
        with pytest.raises(JobStoreError) as refused:
            call()
        assert "s3://stopped/x/" in str(refused.value) and endpoint in str(refused.value)
    assert time.monotonic() - started < 15


def test_a_bucket_that_does_not_exist_is_named_at_open(s3_server):
    with pytest.raises(JobStoreError) as refused:
        ObjectJobStore.from_url("s3://no-such-bucket/jobs", endpoint=s3_server.endpoint).open()
    assert "NoSuchBucket" in str(refused.value) and "'no-such-bucket'" in str(refused.value)
