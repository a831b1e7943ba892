"""The object store's sweep (``ObjectJobStore.sweep``, run by every replica's scan): expired jobs deleted, and in a
full pass every hour, what creates and deletes cut midway left behind.

Due jobs: the ``expiry/<expires_at>-<id>`` markers sort by expiry time, so a sweep lists them only up to now and reads
only the records of the due ones; a marker whose record is gone, or says another expiry (a put moved it), is dropped.

Leftovers (at the store's opening and every ``LEFTOVER_PASS_S``): every object under ``jobs/`` is listed once; the
objects of a job without a record are removed once the newest of them is ``LEFTOVER_AGE_S`` old (a create in progress
is younger: its record comes last), and so are the ``newest/`` and ``active/`` markers of jobs without a record, and
the ``active/`` markers of jobs that finished (a put whose marker removal failed).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from stage_runtime.errors import JobStoreError
from stage_runtime.jobs.record import ACTIVE, JOB_ID, JobRecord
from stage_runtime.jobs.store.base import RECORD
from stage_runtime.jobs.store.s3_client import Bucket

log = logging.getLogger(__name__)
LEFTOVER_PASS_S = 3600.0        # how often the sweep looks for objects of jobs without a record (and stale markers)
LEFTOVER_AGE_S = 3600.0         # such objects older than this are removed (a create in progress is younger)


class Swept(Protocol):              # what the sweep needs of the object store
    prefix: str
    location: str
    clock: Callable[[], float]
    objects: Bucket
    leftovers_at: float

    def get(self, job_id: str) -> JobRecord | None: ...
    def delete(self, job_id: str) -> Any: ...
    def purge(self, trashed: Any) -> None: ...
    def expiry_key(self, record: JobRecord) -> str: ...
    def newest_key(self, job_id: str) -> str: ...
    def active_key(self, job_id: str) -> str: ...


def sweep(store: Swept) -> list[str]:
    """The due jobs deleted (record and objects); the ids expired. The full pass too when an hour has gone by."""
    now, expired = store.clock(), []
    base = f"{store.prefix}expiry/"
    for key in store.objects.keys(base):              # oldest expiry first: the listing stops at the first not due
        stamp, _, job_id = key[len(base):].partition("-")
        if not stamp.isdigit() or int(stamp) > now:
            break
        record = store.get(job_id) if JOB_ID.match(job_id) else None
        if record is not None and record.expired(now):
            trashed = store.delete(job_id)
            if trashed is not None:
                store.purge(trashed)
                expired.append(job_id)
        elif record is None or store.expiry_key(record) != key:
            store.objects.delete(key)
    if now - store.leftovers_at >= LEFTOVER_PASS_S:
        sweep_leftovers(store, now)
    return expired


def sweep_leftovers(store: Swept, now: float) -> None:
    """Objects of jobs without a record and stale markers, removed (see the module's docstring)."""
    store.leftovers_at = now
    base = f"{store.prefix}jobs/"
    newest: dict[str, float] = {}
    objects: dict[str, list[str]] = {}
    with_record: set[str] = set()
    for key, modified in store.objects.objects(base):
        job_id, _, name = key[len(base):].partition("/")
        objects.setdefault(job_id, []).append(key)
        newest[job_id] = max(newest.get(job_id, modified), modified)
        if name == RECORD:
            with_record.add(job_id)
    stale = [key for job_id, keys in objects.items()
             if job_id not in with_record and now - newest[job_id] >= LEFTOVER_AGE_S for key in keys]
    held = {store.newest_key(job_id) for job_id in with_record}
    stale += [key for key, modified in store.objects.objects(f"{store.prefix}newest/")
              if key not in held and now - modified >= LEFTOVER_AGE_S]
    active_base = f"{store.prefix}active/"
    for key, modified in store.objects.objects(active_base):
        job_id = key[len(active_base):]
        if job_id not in with_record:
            if now - modified >= LEFTOVER_AGE_S:
                stale.append(key)
            continue
        try:
            record = store.get(job_id)
        except JobStoreError as exc:
            log.warning("sweep: %s", exc)
            continue
        if record is not None and record.status not in ACTIVE:
            stale.append(key)
    if stale:
        log.info("job store %s: removing %d leftover objects of unfinished creates and deletes, and stale markers",
                 store.location, len(stale))
        store.objects.delete_keys(stale)
