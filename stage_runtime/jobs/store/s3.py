"""The job store on an S3-compatible bucket (``serve --job-store s3://BUCKET/PREFIX``; docs/job-stores.md).

    PREFIX/jobs/<id>/job.json         the record: written last at create (its presence is the job), first to go at a
                                      delete; replaced by its owner with If-Match on its ETag (a delete meanwhile wins)
    PREFIX/jobs/<id>/lease.json       the lease (jobs.store.s3_leases: conditional writes)
    PREFIX/jobs/<id>/reference.png    inputs, outputs (video.mp4, thumbnail.png, frames.zip), checkpoint.safetensors
    PREFIX/newest/<inverted id>       empty markers: newest-first listing is an ordered key range too (each hex digit
                                      v of the id as 15 - v)
    PREFIX/active/<id>                empty markers of the jobs queued or in progress: a scan reads only theirs
    PREFIX/expiry/<expires_at>-<id>   empty markers of the finished jobs by expiry time: a sweep lists the due ones

A PUT replaces an object whole or not at all, so a reader sees the old or the new bytes, and an upload cut midway
leaves what was there; a job's record says ``completed`` only after every output landed. Markers are hints, checked
against the record (a stale one is dropped). Leftovers of a create or a delete cut midway (objects of a job without a
record) are removed by a full pass of the sweep, at the store's opening and every ``LEFTOVER_PASS_S``.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from pydantic import ValidationError

from stage_runtime.config.jobs import S3_URL
from stage_runtime.errors import JobNotFoundError, JobStoreError
from stage_runtime.jobs.record import ACTIVE, JOB_ID, JobRecord
from stage_runtime.jobs.store.base import RECORD
from stage_runtime.jobs.store.s3_client import Conflict, Missing, call, make_client

log = logging.getLogger(__name__)
LEFTOVER_PASS_S = 3600.0        # how often the sweep looks for objects of jobs without a record (and stale markers)
LEFTOVER_AGE_S = 3600.0         # such objects older than this are removed (a create in progress is younger)
INVERT = str.maketrans("0123456789abcdef", "fedcba9876543210")


def inverted(job_id: str) -> str:
    return job_id[:6] + job_id[6:].translate(INVERT)


class ObjectJobStore:
    """The :class:`~stage_runtime.jobs.store.base.JobStore` on an S3-compatible bucket."""

    def __init__(self, bucket: str, prefix: str = "", endpoint: str | None = None, region: str | None = None,
                 clock: Callable[[], float] = time.time, client: Any = None):
        self.bucket, self.endpoint, self.clock = bucket, endpoint, clock
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.location = f"s3://{bucket}/{self.prefix}" + (f" at {endpoint}" if endpoint else "")
        self.client = client or make_client(endpoint, region)
        self._leftovers_at = float("-inf")

    @classmethod
    def from_url(cls, url: str, endpoint: str | None = None, region: str | None = None,
                 clock: Callable[[], float] = time.time) -> ObjectJobStore:
        match = S3_URL.match(url)
        if match is None:
            raise JobStoreError(f"job store {url!r}: not s3://BUCKET/PREFIX")
        return cls(match[1], match[2] or "", endpoint, region, clock)

    # -- keys and calls -----------------------------------------------------------------------------------------
    def key(self, job_id: str, name: str) -> str:
        if not JOB_ID.match(job_id):
            raise JobNotFoundError(f"no video job {job_id!r}: ids look like video_<32 hex digits>")
        return f"{self.prefix}jobs/{job_id}/{name}"

    def _call(self, what: str, method: str, **params: Any) -> Any:
        return call(self.location, what, getattr(self.client, method), Bucket=self.bucket, **params)

    def write_object(self, key: str, data: bytes, **conditions: str) -> str:
        """One PUT (``conditions``: IfNoneMatch / IfMatch); the new object's ETag."""
        return self._call(f"cannot write {key}", "put_object", Key=key, Body=data, **conditions)["ETag"]

    def read_object(self, key: str) -> tuple[bytes, str]:
        """The object's bytes and ETag; Missing when it is not there."""
        answer = self._call(f"cannot read {key}", "get_object", Key=key)
        with answer["Body"] as body:
            return body.read(), answer["ETag"]

    def _keys(self, prefix: str, start_after: str | None = None, limit: int | None = None,
              delimiter: str | None = None) -> Iterator[str]:
        """Keys (or, with ``delimiter``, the common prefixes) under ``prefix`` in order, after ``start_after``."""
        params: dict[str, Any] = {"Prefix": prefix}
        if start_after:
            params["StartAfter"] = start_after
        if delimiter:
            params["Delimiter"] = delimiter
        seen = 0
        while True:
            if limit is not None:
                params["MaxKeys"] = max(1, min(1000, limit - seen))
            page = self._call(f"cannot list {prefix}", "list_objects_v2", **params)
            names = [p["Prefix"] for p in page.get("CommonPrefixes", ())] if delimiter else \
                [o["Key"] for o in page.get("Contents", ())]
            for name in names:
                yield name
                seen += 1
                if limit is not None and seen >= limit:
                    return
            if not page.get("IsTruncated"):
                return
            params["ContinuationToken"] = page["NextContinuationToken"]

    def _delete_keys(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[start:start + 1000]]
            self._call(f"cannot delete {len(batch)} objects", "delete_objects", Delete={"Objects": batch, "Quiet": True})

    def _expiry_key(self, record: JobRecord) -> str:
        return f"{self.prefix}expiry/{int(record.expires_at):012d}-{record.id}"

    # -- the store ------------------------------------------------------------------------------------------------
    def open(self) -> ObjectJobStore:
        probe = f"{self.prefix}.probe/{os.getpid()}-{secrets.token_hex(4)}"
        try:
            self.write_object(probe, b"ok")
            if self.read_object(probe)[0] != b"ok":
                raise JobStoreError(f"job store {self.location}: a probe object read back wrong")
            self._call(f"cannot delete {probe}", "delete_object", Key=probe)
        except Missing:
            raise JobStoreError(f"job store {self.location}: a probe object vanished") from None
        except JobStoreError as exc:
            raise JobStoreError(f"{exc} (does the bucket {self.bucket!r} exist, and may these credentials write "
                                "to it?)") from None
        self._sweep_leftovers(self.clock())
        return self

    def create(self, record: JobRecord, files: dict[str, bytes] | None = None) -> None:
        """Every object of the job first, the record last: a job is never seen without its files."""
        written: list[str] = []             # what landed (a write that timed out may have too: the sweep's)
        try:
            for name, data in (files or {}).items():
                self.write_object(self.key(record.id, name), data)
                written.append(self.key(record.id, name))
            for marker in (f"{self.prefix}newest/{inverted(record.id)}",
                           *([f"{self.prefix}active/{record.id}"] if record.status in ACTIVE else ())):
                self.write_object(marker, b"")
                written.append(marker)
            self.write_object(self.key(record.id, RECORD), record.model_dump_json().encode(), IfNoneMatch="*")
        except (JobStoreError, Conflict) as exc:
            try:
                if written:
                    self._delete_keys(written)
            except JobStoreError as cleanup:
                log.warning("job store: leftovers of a failed create of %s stay for the sweep: %s", record.id, cleanup)
            if isinstance(exc, Conflict):
                raise JobStoreError(f"job store {self.location}: job {record.id} exists already") from None
            raise

    def get(self, job_id: str) -> JobRecord | None:
        try:
            data, _ = self.read_object(self.key(job_id, RECORD))
        except (Missing, JobNotFoundError):
            return None
        try:
            return JobRecord.model_validate(json.loads(data))
        except (ValueError, ValidationError) as exc:
            raise JobStoreError(f"job store {self.location}: cannot read the record of {job_id}: {exc}") from None

    def put(self, record: JobRecord) -> None:
        """Replace the record if it is still there (If-Match on the ETag just read: a delete meanwhile wins)."""
        key = self.key(record.id, RECORD)
        if record.expires_at is not None:
            self.write_object(self._expiry_key(record), b"")
        for _ in range(3):
            try:
                etag = self._call(f"cannot read {key}", "head_object", Key=key)["ETag"]
                self.write_object(key, record.model_dump_json().encode(), IfMatch=etag)
                break
            except Missing:
                raise JobNotFoundError(f"video job {record.id} was deleted") from None
            except Conflict:
                continue                      # replaced between the two calls (a test's or an operator's hand)
        else:
            raise JobStoreError(f"job store {self.location}: the record of {record.id} keeps changing under its owner")
        if record.status not in ACTIVE:
            self._call("cannot drop a marker", "delete_object", Key=f"{self.prefix}active/{record.id}")

    def check_held(self, job_id: str) -> None:
        """JobNotFoundError unless the job's record is there."""
        try:
            self._call(f"cannot read the record of {job_id}", "head_object", Key=self.key(job_id, RECORD))
        except Missing:
            raise JobNotFoundError(f"video job {job_id} was deleted") from None

    def write_file(self, job_id: str, name: str, data: bytes) -> None:
        self.check_held(job_id)
        self.write_object(self.key(job_id, name), data)

    def read_file(self, job_id: str, name: str) -> bytes:
        try:
            return self.read_object(self.key(job_id, name))[0]
        except Missing:
            raise JobNotFoundError(f"video job {job_id} has no {name}") from None

    def remove_file(self, job_id: str, name: str) -> None:
        try:
            self._call(f"cannot remove {name} of {job_id}", "delete_object", Key=self.key(job_id, name))
        except (Missing, JobNotFoundError):
            return

    def file_size(self, job_id: str, name: str) -> int:
        try:
            return int(self._call(f"cannot read {name} of {job_id}", "head_object",
                                  Key=self.key(job_id, name))["ContentLength"])
        except Missing:
            raise JobNotFoundError(f"video job {job_id} has no {name}") from None

    def open_file(self, job_id: str, name: str, start: int = 0) -> BinaryIO:
        ranged = {"Range": f"bytes={start}-"} if start else {}
        try:
            return self._call(f"cannot read {name} of {job_id}", "get_object", Key=self.key(job_id, name),
                              **ranged)["Body"]
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
        """A key range: the jobs' folders in id order, or the ``newest/`` markers for newest first."""
        if order == "desc":
            base = f"{self.prefix}newest/"
            start = base + inverted(after) if after is not None else None
            found = (inverted(k[len(base):]) for k in self._keys(base, start, limit))
            return [job_id for job_id in found if JOB_ID.match(job_id)]
        base = f"{self.prefix}jobs/"
        start = f"{base}{after}/~" if after is not None else None         # past every key of `after`'s folder
        found = (p[len(base):].rstrip("/") for p in self._keys(base, start, limit, delimiter="/"))
        return [job_id for job_id in found if JOB_ID.match(job_id)]

    def active_ids(self) -> list[str]:
        base = f"{self.prefix}active/"
        return [k[len(base):] for k in self._keys(base) if JOB_ID.match(k[len(base):])]

    def records(self) -> list[JobRecord]:
        found = []
        for job_id in self.ids():
            try:
                record = self.get(job_id)
            except JobStoreError as exc:
                log.warning("skipping an unreadable job record: %s", exc)
                continue
            if record is not None:
                found.append(record)
        return found

    # -- removal --------------------------------------------------------------------------------------------------
    def delete(self, job_id: str) -> tuple[str, list[str]] | None:
        """The record gone (the job is gone at once); the job's id and its markers, for :meth:`purge`."""
        record = self.get(job_id)
        if record is None:
            return None
        self._call(f"cannot delete {job_id}", "delete_object", Key=self.key(job_id, RECORD))
        markers = [f"{self.prefix}newest/{inverted(job_id)}", f"{self.prefix}active/{job_id}"]
        if record.expires_at is not None:
            markers.append(self._expiry_key(record))
        return job_id, markers

    def purge(self, trashed: tuple[str, list[str]]) -> None:
        job_id, markers = trashed
        try:
            self._delete_keys([*self._keys(f"{self.prefix}jobs/{job_id}/"), *markers])
        except JobStoreError as exc:
            log.warning("job store: objects of the deleted job %s stay for the sweep: %s", job_id, exc)

    def sweep(self) -> list[str]:
        now, expired = self.clock(), []
        base = f"{self.prefix}expiry/"
        for key in list(self._keys(base)):
            stamp, _, job_id = key[len(base):].partition("-")
            if not stamp.isdigit() or int(stamp) > now:
                break
            record = self.get(job_id) if JOB_ID.match(job_id) else None
            if record is not None and record.expired(now):
                trashed = self.delete(job_id)
                if trashed is not None:
                    self.purge(trashed)
                    expired.append(job_id)
            elif record is None or self._expiry_key(record) != key:
                self._call("cannot drop a marker", "delete_object", Key=key)
        if now - self._leftovers_at >= LEFTOVER_PASS_S:
            self._sweep_leftovers(now)
        return expired

    def _objects(self, prefix: str) -> Iterator[tuple[str, float]]:
        """(key, last modified) of every object under ``prefix``."""
        page: dict[str, Any] = {"Prefix": prefix}
        while True:
            answer = self._call(f"cannot list {prefix}", "list_objects_v2", **page)
            for item in answer.get("Contents", ()):
                yield item["Key"], item["LastModified"].timestamp()
            if not answer.get("IsTruncated"):
                return
            page["ContinuationToken"] = answer["NextContinuationToken"]

    def _sweep_leftovers(self, now: float) -> None:
        """Objects of jobs without a record (a create or a delete cut midway) and markers of jobs without any object,
        older than LEFTOVER_AGE_S (a create in progress is younger), removed."""
        self._leftovers_at = now
        base = f"{self.prefix}jobs/"
        newest: dict[str, float] = {}
        objects: dict[str, list[str]] = {}
        with_record: set[str] = set()
        for key, modified in self._objects(base):
            job_id, _, name = key[len(base):].partition("/")
            objects.setdefault(job_id, []).append(key)
            newest[job_id] = max(newest.get(job_id, 0.0), modified)
            if name == RECORD:
                with_record.add(job_id)
        stale = [k for job_id, keys in objects.items() if job_id not in with_record
                 and now - newest[job_id] >= LEFTOVER_AGE_S for k in keys]
        for marker_base, to_id in ((f"{self.prefix}active/", str), (f"{self.prefix}newest/", inverted)):
            stale += [key for key, modified in self._objects(marker_base)
                      if to_id(key[len(marker_base):]) not in with_record and now - modified >= LEFTOVER_AGE_S]
        if stale:
            log.info("job store %s: removing %d leftover objects of unfinished creates and deletes", self.location,
                     len(stale))
            self._delete_keys(stale)
