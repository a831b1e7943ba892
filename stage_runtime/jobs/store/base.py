"""The job store's interface: what a job is in a store (its record and files under its id) and what every store
promises (the package's ``__init__`` says which stores there are)."""


from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

from stage_runtime.errors import JobStoreError

if TYPE_CHECKING:
    from stage_runtime.jobs.lease import Leases
    from stage_runtime.jobs.record import JobRecord

log = logging.getLogger(__name__)
RECORD, REFERENCE, CHECKPOINT = "job.json", "reference.png", "checkpoint.safetensors"
VIDEO_INPUT = "video_input.npz"                          # a video-to-video job's uploads (VideoInput.to_bytes)
# variant → file; "audio" only for a model that makes sound (LTX-2): the MP4's track alone, as WAV
OUTPUTS = {"video": "video.mp4", "thumbnail": "thumbnail.png", "frames": "frames.zip", "audio": "audio.wav"}
S3_SCHEME = "s3://"


class JobStore(Protocol):
    clock: Callable[[], float]
    location: str                                        # for messages: the folder, or s3://bucket/prefix

    def open(self) -> JobStore:
        """The store proven usable (written and read once); JobStoreError naming it otherwise."""

    def create(self, record: JobRecord, files: dict[str, bytes] | None = None) -> None:
        """The job with its files, all visible at once (the record last) or not at all."""

    def get(self, job_id: str) -> JobRecord | None:
        """The record, or None when the store does not hold the job."""

    def put(self, record: JobRecord) -> None:
        """Replace the record (its owner only); JobNotFoundError when the job was deleted meanwhile."""

    def write_file(self, job_id: str, name: str, data: bytes) -> None:
        """One of the job's files replaced whole; JobNotFoundError when the job was deleted."""

    def read_file(self, job_id: str, name: str) -> bytes: ...

    def remove_file(self, job_id: str, name: str) -> None: ...

    def file_size(self, job_id: str, name: str) -> int:
        """The file's length in bytes; JobNotFoundError when the job or the file is gone."""

    def open_file(self, job_id: str, name: str, start: int = 0) -> BinaryIO:
        """The file to read from byte ``start`` on (``read(n)``, ``close()``); a delete of the job meanwhile does not
        cut the reading short. JobNotFoundError when the job or the file is gone."""

    def presign(self, job_id: str, name: str, expires_s: int, filename: str, content_type: str) -> str | None:
        """A URL a client fetches the file from directly for ``expires_s`` seconds; None when the store has none."""

    def local_path(self, job_id: str, name: str) -> Path | None:
        """A path this process reads and writes the file at directly (the folder store), else None."""

    def ids(self, after: str | None = None, limit: int | None = None, order: str = "asc") -> list[str]:
        """Job ids in creation order (``desc``: newest first), those past ``after`` only: a key range, no record
        read."""

    def records(self) -> list[JobRecord]:
        """Every record, in creation order (:func:`read_records` of every id)."""

    def active_ids(self) -> list[str]:
        """The ids of the jobs that may still run (queued or in progress), oldest first, counted without reading
        every record."""

    def delete(self, job_id: str) -> Any:
        """The job out of the store at once; what :meth:`purge` removes later, or None when it was not held."""

    def purge(self, trashed: Any) -> None: ...

    def sweep(self) -> list[str]:
        """Expired jobs deleted (record and files), leftovers of unfinished creates and deletes removed; the ids
        expired."""

    def leases(self, owner: str, duration: float) -> Leases:
        """The leases of this store, claimed as ``owner`` for ``duration`` seconds at a time."""




def read_records(store: JobStore, ids: Iterable[str]) -> list[JobRecord]:
    """The records of ``ids``, in their order: a job deleted meanwhile is left out, an unreadable record is logged and
    skipped (one bad record never hides the others)."""
    found = []
    for job_id in ids:
        try:
            record = store.get(job_id)
        except JobStoreError as exc:
            log.warning("skipping an unreadable job record: %s", exc)
            continue
        if record is not None:
            found.append(record)
    return found
