"""The job store on an S3-compatible bucket (``serve --job-store s3://BUCKET/PREFIX``; docs/job-stores.md).

    PREFIX/jobs/<id>/job.json         the record: written last at create (its presence is the job), first to go at a
                                      delete; replaced by its owner with If-Match on its ETag (a delete meanwhile wins)
    PREFIX/jobs/<id>/lease.json       the lease (jobs.store.s3_leases: conditional writes)
    PREFIX/jobs/<id>/reference.png    inputs, outputs (video.mp4, thumbnail.png, frames.zip), checkpoint.safetensors
    PREFIX/newest/<inverted id>       empty markers: newest-first listing is an ordered key range too (each hex digit
                                      v of the id as 15 - v; S3 lists keys in ascending order only)
    PREFIX/active/<id>                empty markers of the jobs queued or in progress: a scan reads only theirs
    PREFIX/expiry/<expires_at>-<id>   empty markers of the finished jobs by expiry time (12 digits, epoch seconds):
                                      a sweep lists only the due ones (jobs.store.s3_sweep)
    PREFIX/.probe/<pid>-<random>      written, read and removed once by ``open()``

A PUT replaces an object whole or not at all, so a reader sees the old or the new bytes, and an upload cut midway
leaves what was there; a job's record says ``completed`` only after every output landed. Markers are hints, checked
against the record (a stale one is passed over, and dropped by the sweep). A create that fails removes what it wrote
unless its record may have landed; leftovers of a create or a delete cut midway (objects of a job without a record)
are removed by a full pass of the sweep, at the store's opening and every hour.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from collections.abc import Callable
from typing import Any, BinaryIO

from pydantic import ValidationError

from stage_runtime.config.jobs import S3_URL
from stage_runtime.errors import JobNotFoundError, JobStoreError
from stage_runtime.jobs.record import ACTIVE, JOB_ID, JobRecord
from stage_runtime.jobs.store.base import RECORD, read_records
from stage_runtime.jobs.store.s3_client import Bucket, Conflict, Missing, make_client
from stage_runtime.jobs.store.s3_sweep import sweep, sweep_leftovers

log = logging.getLogger(__name__)
INVERT = str.maketrans("0123456789abcdef", "fedcba9876543210")


def inverted(job_id: str) -> str:
    """The id with every hex digit v as 15 - v (``video_`` kept): inverted ids sort newest first."""
    return job_id[:6] + job_id[6:].translate(INVERT)


class ObjectJobStore:
    """The :class:`~stage_runtime.jobs.store.base.JobStore` on an S3-compatible bucket."""

    def __init__(self, bucket: str, prefix: str = "", endpoint: str | None = None, region: str | None = None,
                 clock: Callable[[], float] = time.time, client: Any = None):
        self.bucket, self.endpoint, self.clock = bucket, endpoint, clock
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.location = f"s3://{bucket}/{self.prefix}" + (f" at {endpoint}" if endpoint else "")
        self.client = client or make_client(endpoint, region)
        self.objects = Bucket(bucket, self.location, self.client)
        self.leftovers_at = float("-inf")           # when the sweep's last full pass ran (jobs.store.s3_sweep)

    @classmethod
    def from_url(cls, url: str, endpoint: str | None = None, region: str | None = None,
                 clock: Callable[[], float] = time.time) -> ObjectJobStore:
        match = S3_URL.match(url)
        if match is None:
            raise JobStoreError(f"job store {url!r}: not s3://BUCKET/PREFIX")
        return cls(match[1], match[2] or "", endpoint, region, clock)

    # -- keys -----------------------------------------------------------------------------------------------------
    def key(self, job_id: str, name: str) -> str:
        if not JOB_ID.match(job_id):
            raise JobNotFoundError(f"no video job {job_id!r}: ids look like video_<32 hex digits>")
        return f"{self.prefix}jobs/{job_id}/{name}"

    def newest_key(self, job_id: str) -> str:
        return f"{self.prefix}newest/{inverted(job_id)}"

    def active_key(self, job_id: str) -> str:
        return f"{self.prefix}active/{job_id}"

    def expiry_key(self, record: JobRecord) -> str:
        return f"{self.prefix}expiry/{int(record.expires_at):012d}-{record.id}"

    # -- the store ------------------------------------------------------------------------------------------------
    def open(self) -> ObjectJobStore:
        probe = f"{self.prefix}.probe/{os.getpid()}-{secrets.token_hex(4)}"
        try:
            self.objects.write(probe, b"ok")
            if self.objects.read(probe)[0] != b"ok":
                raise JobStoreError(f"job store {self.location}: a probe object read back wrong")
            self.objects.delete(probe)
        except Missing:
            raise JobStoreError(f"job store {self.location}: a probe object vanished") from None
        except JobStoreError as exc:
            raise JobStoreError(f"{exc} (does the bucket {self.bucket!r} exist, and may these credentials write "
                                "to it?)") from None
        sweep_leftovers(self, self.clock())
        return self

    def create(self, record: JobRecord, files: dict[str, bytes] | None = None) -> None:
        """Every object of the job first, the record last (If-None-Match): a job is never seen without its files. An
        id the store holds is refused before anything is written."""
        record_key, body = self.key(record.id, RECORD), record.model_dump_json().encode()
        try:
            self.objects.head(record_key)
            raise JobStoreError(f"job store {self.location}: job {record.id} exists already")
        except Missing:
            pass
        written: list[str] = []            # listed before each write: one that timed out may have landed
        try:
            for key, data in [*((self.key(record.id, name), data) for name, data in (files or {}).items()),
                              (self.newest_key(record.id), b""),
                              *([(self.active_key(record.id), b"")] if record.status in ACTIVE else [])]:
                written.append(key)
                self.objects.write(key, data)
        except JobStoreError:
            self._drop(written, record.id)  # no record points at them yet
            raise
        try:
            self.objects.write(record_key, body, IfNoneMatch="*")
            return
        except Conflict:
            failure = JobStoreError(f"job store {self.location}: job {record.id} exists already")
        except JobStoreError as exc:
            failure = exc
        try:                               # did the record land (its answer lost, or a retry met it)?
            landed = self.objects.read(record_key)[0]
        except Missing:
            self._drop(written, record.id)
            raise failure from None
        except JobStoreError as exc:
            log.warning("job store: the record of %s may have landed; its objects stay (the sweep removes them if it "
                        "did not): %s", record.id, exc)
            raise failure from None
        if landed != body:
            raise failure

    def _drop(self, keys: list[str], job_id: str) -> None:
        """Objects of a create that failed, removed (or left for the sweep if the store refuses)."""
        try:
            if keys:
                self.objects.delete_keys(keys)
        except JobStoreError as exc:
            log.warning("job store: leftovers of a failed create of %s stay for the sweep: %s", job_id, exc)

    def get(self, job_id: str) -> JobRecord | None:
        try:
            data, _ = self.objects.read(self.key(job_id, RECORD))
        except (Missing, JobNotFoundError):
            return None
        try:
            return JobRecord.model_validate(json.loads(data))
        except (ValueError, ValidationError) as exc:
            raise JobStoreError(f"job store {self.location}: cannot read {self.key(job_id, RECORD)}: {exc}") from None

    def put(self, record: JobRecord) -> None:
        """Replace the record if it is still there (If-Match on the ETag just read: a delete meanwhile wins)."""
        key = self.key(record.id, RECORD)
        if record.expires_at is not None:
            self.objects.write(self.expiry_key(record), b"")
        for _ in range(3):
            try:
                self.objects.write(key, record.model_dump_json().encode(), IfMatch=self.objects.head(key)["ETag"])
                break
            except Missing:
                raise JobNotFoundError(f"video job {record.id} was deleted") from None
            except Conflict:
                continue                      # replaced between the two calls (a retried write of this one, a hand)
        else:
            raise JobStoreError(f"job store {self.location}: {key} keeps changing under its owner")
        if record.status not in ACTIVE:
            self.objects.delete(self.active_key(record.id))

    def check_held(self, job_id: str) -> None:
        """JobNotFoundError unless the job's record is there."""
        try:
            self.objects.head(self.key(job_id, RECORD))
        except Missing:
            raise JobNotFoundError(f"video job {job_id} was deleted") from None

    def write_file(self, job_id: str, name: str, data: bytes) -> None:
        self.check_held(job_id)
        self.objects.write(self.key(job_id, name), data)

    def read_file(self, job_id: str, name: str) -> bytes:
        try:
            return self.objects.read(self.key(job_id, name))[0]
        except Missing:
            raise JobNotFoundError(f"video job {job_id} has no {name}") from None

    def remove_file(self, job_id: str, name: str) -> None:
        try:
            self.objects.delete(self.key(job_id, name))
        except (Missing, JobNotFoundError):
            return

    def file_size(self, job_id: str, name: str) -> int:
        try:
            return int(self.objects.head(self.key(job_id, name))["ContentLength"])
        except Missing:
            raise JobNotFoundError(f"video job {job_id} has no {name}") from None

    def open_file(self, job_id: str, name: str, start: int = 0) -> BinaryIO:
        """The object's body, streamed from byte ``start`` (a ranged GET); it reads on after a delete of the job."""
        key = self.key(job_id, name)
        ranged = {"Range": f"bytes={start}-"} if start else {}
        try:
            return self.objects.call(f"cannot read {key}", "get_object", Key=key, **ranged)["Body"]
        except Missing:
            raise JobNotFoundError(f"video job {job_id} has no {name}") from None

    def presign(self, job_id: str, name: str, expires_s: int, filename: str, content_type: str) -> str:
        """Signed here with the store's credentials (no call to the server)."""
        return self.client.generate_presigned_url("get_object", ExpiresIn=expires_s, Params={
            "Bucket": self.bucket, "Key": self.key(job_id, name), "ResponseContentType": content_type,
            "ResponseContentDisposition": f'attachment; filename="{filename}"'})

    def local_path(self, job_id: str, name: str) -> None:
        return None

    def leases(self, owner: str, duration: float):
        from stage_runtime.jobs.store.s3_leases import ObjectLeases
        return ObjectLeases(self, owner, duration, self.clock)

    def ids(self, after: str | None = None, limit: int | None = None, order: str = "asc") -> list[str]:
        """A key range: the jobs' folders in id order, or the ``newest/`` markers for newest first (a job being
        created may be listed before its record is there: a reader passes over an id without a record)."""
        if order == "desc":
            base = f"{self.prefix}newest/"
            start = base + inverted(after) if after is not None else None
            found = (inverted(k[len(base):]) for k in self.objects.keys(base, start, limit))
            return [job_id for job_id in found if JOB_ID.match(job_id)]
        base = f"{self.prefix}jobs/"
        start = f"{base}{after}/~" if after is not None else None         # past every key of `after`'s folder
        found = (p[len(base):].rstrip("/") for p in self.objects.keys(base, start, limit, delimiter="/"))
        return [job_id for job_id in found if JOB_ID.match(job_id)]

    def active_ids(self) -> list[str]:
        base = f"{self.prefix}active/"
        return [k[len(base):] for k in self.objects.keys(base) if JOB_ID.match(k[len(base):])]

    def records(self) -> list[JobRecord]:
        return read_records(self, self.ids())

    # -- removal --------------------------------------------------------------------------------------------------
    def delete(self, job_id: str) -> tuple[str, list[str]] | None:
        """The record gone (the job is gone at once); the job's id and its markers, for :meth:`purge`."""
        record = self.get(job_id)
        if record is None:
            return None
        self.objects.delete(self.key(job_id, RECORD))
        markers = [self.newest_key(job_id), self.active_key(job_id)]
        if record.expires_at is not None:
            markers.append(self.expiry_key(record))
        return job_id, markers

    def purge(self, trashed: tuple[str, list[str]]) -> None:
        """The rest of a deleted job removed: its objects (one listing) and markers, in batches."""
        job_id, markers = trashed
        try:
            self.objects.delete_keys([*self.objects.keys(f"{self.prefix}jobs/{job_id}/"), *markers])
        except JobStoreError as exc:
            log.warning("job store: objects of the deleted job %s stay for the sweep: %s", job_id, exc)

    def sweep(self) -> list[str]:
        """Expired jobs deleted (only the due ``expiry/`` markers are listed); every hour, leftovers removed."""
        return sweep(self)
