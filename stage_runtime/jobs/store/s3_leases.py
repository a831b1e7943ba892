"""The object store's leases (``jobs.lease`` says what a lease is and how it is renewed): one object per job,
``PREFIX/jobs/<id>/lease.json`` ({owner, token, generation, expires_at}), written only by conditional writes.

A first claim creates it with ``If-None-Match: *``; a takeover (the lease expired or was released), a renewal and a
release replace it with ``If-Match: <ETag>`` — the ETag this replica read (a takeover) or last wrote (its own
renewals, ``Lease.version``). Of any number of replicas writing against one ETag exactly one succeeds; the others
get 412 (or 409 while writes race) and hold nothing. A renewal that finds the object changed (another replica took
the job) loses the lease. S3 has both conditions on PutObject (AWS since 2024; MinIO, R2, Ceph RGW, GCS's S3 API).

A write whose answer was lost may land all the same (botocore's retry of it then gets 412; a renewal that timed out
while the store stalled lands when it is back). On a 412 the lease is read back: its very content (this claim's
random token, its expiry) is this write, landed; this claim's generation and token with a later expiry is an earlier
renewal of this replica that landed unseen, and the write is tried once more on the ETag read. Only the claim's
holder ever writes its token, so neither can mistake another replica's lease for its own.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Callable
from typing import Protocol

from stage_runtime.errors import JobNotFoundError
from stage_runtime.jobs.lease import Lease, free, usable
from stage_runtime.jobs.store.s3_client import Bucket, Conflict, Missing

LEASE = "lease.json"


class Objects(Protocol):                     # what the leases need of the object store
    objects: Bucket

    def key(self, job_id: str, name: str) -> str: ...
    def check_held(self, job_id: str) -> None: ...


class ObjectLeases:
    """The leases of one object store, claimed as ``owner`` for ``duration`` seconds at a time."""

    def __init__(self, store: Objects, owner: str, duration: float, clock: Callable[[], float] = time.time):
        self.store, self.owner, self.duration, self.clock = store, owner, duration, clock

    def current(self, job_id: str) -> Lease | None:
        try:
            data, etag = self.store.objects.read(self.store.key(job_id, LEASE))
        except (Missing, JobNotFoundError):
            return None
        return Lease.decode(job_id, data, etag)

    def free(self, job_id: str) -> bool:
        return free(self, job_id)

    def _write(self, lease: Lease, **condition: str) -> Lease | None:
        """``lease`` written on its condition, with the new ETag; None when another replica's write came first (or
        the job and its lease are gone)."""
        key, data = self.store.key(lease.job_id, LEASE), lease.encode()
        for _ in range(2):
            try:
                return dataclasses.replace(lease, version=self.store.objects.write(key, data, **condition))
            except Missing:
                return None
            except Conflict:
                pass
            try:
                there, etag = self.store.objects.read(key)
            except Missing:
                return None
            if there == data:                # this very write: its answer was lost and botocore's retry refused
                return dataclasses.replace(lease, version=etag)
            current = Lease.decode(lease.job_id, there, etag)
            if "IfMatch" not in condition or (current.generation, current.token) != (lease.generation, lease.token) \
                    or current.expires_at <= self.clock():
                return None
            condition = {"IfMatch": etag}    # an earlier write of this claim landed unseen (a renewal timed out
        return None                          # while the store stalled): the claim is still this replica's

    def claim(self, job_id: str) -> Lease | None:
        try:
            self.store.check_held(job_id)
        except JobNotFoundError:
            return None
        now = self.clock()
        current = self.current(job_id)
        if current is not None and now < current.expires_at:
            return None
        lease = Lease(job_id, 1 if current is None else current.generation + 1, self.owner, secrets.token_hex(8),
                      now + self.duration)
        return self._write(lease, **({"IfNoneMatch": "*"} if current is None else {"IfMatch": current.version}))

    def holds(self, lease: Lease) -> bool:
        if not usable(self, lease):
            return False
        current = self.current(lease.job_id)
        return current is not None and (current.generation, current.token, current.version) == (
            lease.generation, lease.token, lease.version)

    def renew(self, lease: Lease) -> Lease | None:
        if not usable(self, lease):
            return None
        return self._write(dataclasses.replace(lease, expires_at=self.clock() + self.duration), IfMatch=lease.version)

    def release(self, lease: Lease) -> None:
        if usable(self, lease):
            self._write(dataclasses.replace(lease, expires_at=0.0), IfMatch=lease.version)
