"""The object store's leases (``jobs.lease`` says what a lease is and how it is renewed): one object per job,
``PREFIX/jobs/<id>/lease.json`` ({owner, token, generation, expires_at}), written only by conditional writes.

A first claim creates it with ``If-None-Match: *``; a takeover (the lease expired or was released), a renewal and a
release replace it with ``If-Match: <ETag>`` — the ETag this replica read (a takeover) or last wrote (its own
renewals, ``Lease.version``). Of any number of replicas writing against one ETag exactly one succeeds; the others
get 412 and hold nothing. A renewal that finds the object changed (another replica took the job) loses the lease.
S3 has both conditions on PutObject (AWS since 2024; MinIO, R2, Ceph RGW, GCS's S3 API).
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Callable
from typing import Protocol

from stage_runtime.errors import JobNotFoundError
from stage_runtime.jobs.lease import Lease, free, usable
from stage_runtime.jobs.store.s3_client import Conflict, Missing

LEASE = "lease.json"


class Objects(Protocol):                     # what the leases need of the object store
    def key(self, job_id: str, name: str) -> str: ...
    def read_object(self, key: str) -> tuple[bytes, str]: ...
    def write_object(self, key: str, data: bytes, **conditions: str) -> str: ...
    def check_held(self, job_id: str) -> None: ...


class ObjectLeases:
    """The leases of one object store, claimed as ``owner`` for ``duration`` seconds at a time."""

    def __init__(self, store: Objects, owner: str, duration: float, clock: Callable[[], float] = time.time):
        self.store, self.owner, self.duration, self.clock = store, owner, duration, clock

    def current(self, job_id: str) -> Lease | None:
        try:
            data, etag = self.store.read_object(self.store.key(job_id, LEASE))
        except (Missing, JobNotFoundError):
            return None
        return Lease.decode(job_id, data, etag)

    def free(self, job_id: str) -> bool:
        return free(self, job_id)

    def _write(self, lease: Lease, **condition: str) -> Lease | None:
        try:
            etag = self.store.write_object(self.store.key(lease.job_id, LEASE), lease.encode(), **condition)
        except (Conflict, Missing):          # another replica wrote it first; or the job (and its lease) is gone
            return None
        return dataclasses.replace(lease, version=etag)

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
