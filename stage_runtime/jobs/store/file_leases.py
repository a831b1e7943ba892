"""The folder store's leases (``jobs.lease`` says what a lease is and how it is renewed): files in the job's folder.

A lease is a file ``lease-<generation>.json`` ({owner, token, generation, expires_at}); the highest generation
is the job's lease. Claiming writes the next generation's file under a temp name and hard-links it to its
real name: the link fails when the name exists, so of any number of replicas claiming one generation exactly
one wins, on every POSIX filesystem and NFS. A claim is tried only when the current lease has expired (or was
released, ``expires_at`` 0; a queued job has none). Lease files are never removed while the job exists, so a
generation can never be claimed twice, however late a claimer is. The owner renews its own file (a temp file
renamed over it).
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from stage_runtime.atomic_file import write_atomic
from stage_runtime.errors import JobNotFoundError
from stage_runtime.jobs.lease import Lease, free, usable


class Folders(Protocol):                     # what the leases need of the folder store
    def folder(self, job_id: str) -> Path: ...

LEASE_FILE = re.compile(r"^lease-(\d{8})\.json$")


def file_name(lease: Lease) -> str:
    return f"lease-{lease.generation:08d}.json"


class FileLeases:
    """The leases of one folder store, claimed as ``owner`` for ``duration`` seconds at a time."""

    def __init__(self, store: Folders, owner: str, duration: float, clock: Callable[[], float] = time.time):
        self.store, self.owner, self.duration, self.clock = store, owner, duration, clock

    def current(self, job_id: str) -> Lease | None:
        """The job's lease (its highest generation), or None: never claimed, or the job is gone."""
        try:
            folder = self.store.folder(job_id)
            generations = [int(m[1]) for name in os.listdir(folder) if (m := LEASE_FILE.match(name))]
        except (FileNotFoundError, JobNotFoundError):
            return None
        if not generations:
            return None
        path = folder / f"lease-{max(generations):08d}.json"
        try:
            return Lease.decode(job_id, path.read_bytes())
        except FileNotFoundError:           # lease files go only with the folder: the job is gone
            return None

    def free(self, job_id: str) -> bool:
        return free(self, job_id)

    def claim(self, job_id: str) -> Lease | None:
        """This replica's lease on the job, or None: another holds a live lease, won this generation, or the
        job is gone."""
        now = self.clock()
        current = self.current(job_id)
        if current is not None and now < current.expires_at:
            return None
        lease = Lease(job_id, 1 if current is None else current.generation + 1, self.owner, secrets.token_hex(8),
                      now + self.duration)
        try:
            folder = self.store.folder(job_id)
        except JobNotFoundError:
            return None
        temp = folder / f".lease-{lease.token}.tmp"
        try:
            with open(temp, "xb") as out:
                out.write(lease.encode())
                out.flush()
                os.fsync(out.fileno())
            os.link(temp, folder / file_name(lease))
        except (FileExistsError, FileNotFoundError):
            return None
        finally:
            temp.unlink(missing_ok=True)
        return lease

    def holds(self, lease: Lease) -> bool:
        """Whether ``lease`` is still the job's lease and runs for a while yet by this replica's clock."""
        if not usable(self, lease):
            return False
        current = self.current(lease.job_id)
        return current is not None and (current.generation, current.token) == (lease.generation, lease.token)

    def renew(self, lease: Lease) -> Lease | None:
        """The lease extended by ``duration`` from now, or None: it is lost (expired by this clock, another
        generation claimed, the job deleted) and the run must stop."""
        if not self.holds(lease):
            return None
        renewed = dataclasses.replace(lease, expires_at=self.clock() + self.duration)
        try:
            write_atomic(self.store.folder(lease.job_id) / file_name(lease), renewed.encode())
        except FileNotFoundError:
            return None
        return renewed

    def release(self, lease: Lease) -> None:
        """Give the job up now (``expires_at`` 0): any replica may claim it at once."""
        if not self.holds(lease):
            return
        try:
            write_atomic(self.store.folder(lease.job_id) / file_name(lease), dataclasses.replace(lease, expires_at=0.0).encode())
        except FileNotFoundError:
            return
