"""Where video jobs live: the interface every part of the job service uses (:class:`JobStore`, with its
:class:`~stage_runtime.jobs.lease.Leases`), and its two implementations.

    base.py          the interface (JobStore) and the names of a job's files
    filesystem.py    FileJobStore — a folder every replica shares (a ReadWriteMany volume): ``--job-store DIR``
    file_leases.py   its leases: one file per generation, claimed by a hard link (exclusive on POSIX and NFS)
    s3.py            ObjectJobStore — an S3-compatible bucket: ``--job-store s3://BUCKET/PREFIX``
    s3_leases.py     its leases: one object per job, claimed and renewed by conditional writes (If-None-Match,
                     If-Match on the ETag)
    s3_client.py     its boto3 client, the calls on the bucket, what their errors mean (Missing, Conflict,
                     JobStoreError)
    s3_sweep.py      its sweep: the due expiries by their index, an hourly pass for leftovers and stale markers

A job is a record (``jobs.record``) and its files (``RECORD``, ``REFERENCE``, ``OUTPUTS``, ``CHECKPOINT``), under
its id. Both stores keep the same promises, held by one conformance suite (tests/stage_runtime/jobs/test_store_
conformance.py): a job appears with all of its create's files or not at all; a file is replaced whole; ids list in
creation order from any ``after`` without reading a record; exactly one replica holds a job's lease at a time.
Every call may raise :class:`~stage_runtime.errors.JobStoreError` (out of reach, refused: retry later) and
:class:`~stage_runtime.errors.JobNotFoundError` (the job is gone).
"""

from __future__ import annotations

from collections.abc import Callable

from stage_runtime.jobs.store.base import CHECKPOINT, OUTPUTS, RECORD, REFERENCE, S3_SCHEME, VIDEO_INPUT, JobStore

__all__ = ["CHECKPOINT", "OUTPUTS", "RECORD", "REFERENCE", "VIDEO_INPUT", "JobStore", "open_job_store"]


def open_job_store(location: str, endpoint: str | None = None, region: str | None = None,
                   clock: Callable[[], float] | None = None) -> JobStore:
    """The store ``--job-store`` names (a folder, or ``s3://BUCKET/PREFIX``), not yet opened."""
    import time
    clock = clock or time.time
    if location.startswith(S3_SCHEME):
        from stage_runtime.jobs.store.s3 import ObjectJobStore
        return ObjectJobStore.from_url(location, endpoint=endpoint, region=region, clock=clock)
    from stage_runtime.jobs.store.filesystem import FileJobStore
    return FileJobStore(location, clock=clock)
