"""The job store on a shared folder (``serve --job-store DIR``): every replica pointed at DIR sees every job.

    DIR/jobs/<id>/job.json          the record (jobs.record), replaced atomically (a temp file, then rename)
    DIR/jobs/<id>/lease-<n>.json    who runs it (jobs.store.file_leases)
    DIR/jobs/<id>/reference.png     the image-to-video input, when the job has one
    DIR/jobs/<id>/video.mp4         the outputs, once completed: the MP4 (H.264), the first frame as a PNG,
    DIR/jobs/<id>/thumbnail.png         and the exact frames as a zip of PNGs
    DIR/jobs/<id>/frames.zip
    DIR/jobs/<id>/checkpoint.safetensors   the newest step checkpoint while the job runs (stage_runtime.checkpoint)
    DIR/incoming/<id>.<random>/     a job being created: written whole, then renamed into jobs/
    DIR/trash/<id>.<random>/        a deleted or expired job: renamed here whole, then removed

A job appears (created) and disappears (deleted, expired) by one rename of its folder, so a record is never
seen without its files, nor its files without it. Only the job's owner writes its record after the create;
every file is written to a temp name first and renamed over the real one, so a reader sees the old or the new
content, never part of it. Anything that needs POSIX renames and hard links works: a local disk, NFS, CephFS.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from pydantic import ValidationError

from stage_runtime.atomic_file import write_atomic
from stage_runtime.errors import JobNotFoundError, JobStoreError
from stage_runtime.jobs.record import ACTIVE, JOB_ID, JobRecord
from stage_runtime.jobs.store.base import RECORD, read_records

log = logging.getLogger(__name__)
INCOMING_STALE_S = 3600.0          # a create that never finished (its process died) is removed after this
TRASH_STALE_S = 60.0               # a trashed folder its deleter did not finish removing


class FileJobStore:
    """The :class:`~stage_runtime.jobs.store.JobStore` on a shared folder."""

    def __init__(self, root: str | Path, clock: Callable[[], float] = time.time):
        self.root = Path(root)
        self.location = str(self.root)
        self.jobs, self.incoming, self.trash = self.root / "jobs", self.root / "incoming", self.root / "trash"
        self.clock = clock

    def open(self) -> FileJobStore:
        """Make the layout and prove the folder writable (JobStoreError naming the folder otherwise)."""
        try:
            for folder in (self.jobs, self.incoming, self.trash):
                folder.mkdir(parents=True, exist_ok=True)
            write_atomic(self.incoming / f".probe-{os.getpid()}", b"ok")
            (self.incoming / f".probe-{os.getpid()}").unlink()
        except OSError as exc:
            raise JobStoreError(f"job store {str(self.root)!r} is not a writable folder: "
                                f"{exc.strerror or exc}") from None
        return self

    def folder(self, job_id: str) -> Path:
        if not JOB_ID.match(job_id):
            raise JobNotFoundError(f"no video job {job_id!r}: ids look like video_<32 hex digits>")
        return self.jobs / job_id

    # -- records ------------------------------------------------------------------------------------------
    def create(self, record: JobRecord, files: dict[str, bytes] | None = None) -> None:
        """The job's folder, whole: written under incoming/, then renamed into jobs/ (one atomic step)."""
        staging = self.incoming / f"{record.id}.{secrets.token_hex(4)}"
        try:
            staging.mkdir()
            for name, data in (files or {}).items():
                write_atomic(staging / name, data)
            write_atomic(staging / RECORD, record.model_dump_json().encode())
            os.rename(staging, self.folder(record.id))
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise JobStoreError(f"job store {str(self.root)!r}: cannot create job {record.id}: "
                                f"{exc.strerror or exc}") from None

    def get(self, job_id: str) -> JobRecord | None:
        """The record, or None when the store does not hold the job (never made, deleted, expired-and-swept)."""
        try:
            path = self.folder(job_id) / RECORD
        except JobNotFoundError:
            return None
        try:
            return JobRecord.model_validate(json.loads(path.read_bytes()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, ValidationError) as exc:
            raise JobStoreError(f"job store: cannot read {path}: {exc}") from None

    def put(self, record: JobRecord) -> None:
        """Replace the record (its owner only). JobNotFoundError when the job was deleted meanwhile."""
        try:
            write_atomic(self.folder(record.id) / RECORD, record.model_dump_json().encode())
        except FileNotFoundError:
            raise JobNotFoundError(f"video job {record.id} was deleted") from None
        except OSError as exc:
            raise JobStoreError(f"job store: cannot write the record of {record.id}: {exc.strerror or exc}") from None

    def write_file(self, job_id: str, name: str, data: bytes) -> None:
        try:
            write_atomic(self.folder(job_id) / name, data)
        except FileNotFoundError:
            raise JobNotFoundError(f"video job {job_id} was deleted") from None
        except OSError as exc:
            raise JobStoreError(f"job store: cannot write {name} of {job_id}: {exc.strerror or exc}") from None

    def remove_file(self, job_id: str, name: str) -> None:
        """The file gone (it was not there, or the job was deleted: nothing to do)."""
        try:
            (self.folder(job_id) / name).unlink(missing_ok=True)
        except (FileNotFoundError, JobNotFoundError):
            return
        except OSError as exc:
            raise JobStoreError(f"job store: cannot remove {name} of {job_id}: {exc.strerror or exc}") from None

    def read_file(self, job_id: str, name: str) -> bytes:
        try:
            return (self.folder(job_id) / name).read_bytes()
        except FileNotFoundError:
            raise JobNotFoundError(f"video job {job_id} has no {name}") from None

    def file_size(self, job_id: str, name: str) -> int:
        try:
            return (self.folder(job_id) / name).stat().st_size
        except FileNotFoundError:
            raise JobNotFoundError(f"video job {job_id} has no {name}") from None

    def open_file(self, job_id: str, name: str, start: int = 0) -> BinaryIO:
        try:
            handle = open(self.folder(job_id) / name, "rb")      # an open file outlives a rename or unlink
        except FileNotFoundError:
            raise JobNotFoundError(f"video job {job_id} has no {name}") from None
        except OSError as exc:
            raise JobStoreError(f"job store: cannot read {name} of {job_id}: {exc.strerror or exc}") from None
        handle.seek(start)
        return handle

    def presign(self, job_id: str, name: str, expires_s: int, filename: str, content_type: str) -> None:
        return None                        # a folder has no URL of its own: the stage streams the file

    def local_path(self, job_id: str, name: str) -> Path:
        return self.folder(job_id) / name

    def leases(self, owner: str, duration: float):
        from stage_runtime.jobs.store.file_leases import FileLeases
        return FileLeases(self, owner, duration, self.clock)

    def ids(self, after: str | None = None, limit: int | None = None, order: str = "asc") -> list[str]:
        """Job ids in creation order (the folder's names sort by it), past ``after``, at most ``limit``."""
        try:
            ids = sorted(name for name in os.listdir(self.jobs) if JOB_ID.match(name))
        except OSError as exc:
            raise JobStoreError(f"job store {str(self.root)!r}: cannot list jobs: {exc.strerror or exc}") from None
        if order == "desc":
            ids.reverse()
        if after is not None:
            ids = [i for i in ids if (i > after if order == "asc" else i < after)]
        return ids if limit is None else ids[:limit]

    def active_ids(self) -> list[str]:
        """The queued and in-progress jobs (a folder has no index: the records are read; they are local files)."""
        return [record.id for record in self.records() if record.status in ACTIVE]

    def records(self) -> list[JobRecord]:
        """Every record, in creation order (a job deleted while listing is left out)."""
        return read_records(self, self.ids())

    # -- removal ------------------------------------------------------------------------------------------
    def delete(self, job_id: str) -> Path | None:
        """Take the job out of the store at once (its folder renamed into trash/); the trash folder to
        :meth:`purge`, or None when the store did not hold it."""
        target = self.trash / f"{job_id}.{secrets.token_hex(4)}"
        try:
            os.rename(self.folder(job_id), target)
        except FileNotFoundError:
            return None
        except JobNotFoundError:
            return None
        except OSError as exc:
            raise JobStoreError(f"job store: cannot delete {job_id}: {exc.strerror or exc}") from None
        return target

    @staticmethod
    def purge(folder: Path) -> None:
        """Remove a trashed folder; what a late writer left in it goes at the next sweep."""
        def report(function, path, exc_info) -> None:
            if isinstance(exc_info[1], FileNotFoundError):        # another replica's purge got there first
                return
            log.warning("job store: cannot remove %s (%s); the next sweep retries", path, exc_info[1])

        shutil.rmtree(folder, onerror=report)

    def sweep(self) -> list[str]:
        """Delete every expired job (record and files together), empty the trash, drop stale creates.
        Returns the ids it expired."""
        now = self.clock()
        expired = []
        for job_id in self.ids():
            try:
                record = self.get(job_id)
            except JobStoreError as exc:
                log.warning("sweep: %s", exc)
                continue
            if record is not None and record.expired(now):
                trashed = self.delete(job_id)
                if trashed is not None:
                    self.purge(trashed)
                    expired.append(job_id)
        for folder, older_than in ((self.trash, TRASH_STALE_S), (self.incoming, INCOMING_STALE_S)):
            for entry in list(folder.iterdir()):
                if entry.is_dir() and self._age(entry, now) >= older_than:
                    self.purge(entry)
        return expired

    @staticmethod
    def _age(path: Path, now: float) -> float:
        try:
            return now - path.stat().st_mtime
        except FileNotFoundError:
            return 0.0
