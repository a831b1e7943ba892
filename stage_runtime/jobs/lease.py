"""Exactly one runner per job: a lease in the job's folder that its owner renews and another replica takes
once it expires.

A lease is a file ``lease-<generation>.json`` ({owner, token, generation, expires_at}); the highest generation
is the job's lease. Claiming writes the next generation's file under a temp name and hard-links it to its
real name: the link fails when the name exists, so of any number of replicas claiming one generation exactly
one wins, on every POSIX filesystem and NFS. A claim is tried only when the current lease has expired (or was
released, ``expires_at`` 0; a queued job has none). Lease files are never removed while the job exists, so a
generation can never be claimed twice, however late a claimer is.

The owner renews its own file (a temp file renamed over it) every third of the lease, and only while its lease
still runs by its own clock with a tenth of the lease to spare: a replica whose renewals stopped (killed,
partitioned, its loop stalled) never renews after another could have claimed. Replicas' clocks must agree
within that tenth (NTP does).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from stage_runtime.errors import JobNotFoundError
from stage_runtime.atomic_file import write_atomic
from stage_runtime.jobs.store import JobStore

LEASE_FILE = re.compile(r"^lease-(\d{8})\.json$")
SPARE = 0.1              # of the lease: the owner stops renewing this long before it ends


@dataclass(frozen=True)
class Lease:
    job_id: str
    generation: int
    owner: str               # the replica (host-pid), for people
    token: str               # this claim (a replica restarted with the same name is another owner)
    expires_at: float        # wall-clock seconds; 0: released

    @property
    def name(self) -> str:
        return f"lease-{self.generation:08d}.json"

    def encode(self) -> bytes:
        return json.dumps({k: v for k, v in dataclasses.asdict(self).items() if k != "job_id"}).encode()


class Leases:
    """The leases of one store, claimed as ``owner`` for ``duration`` seconds at a time."""

    def __init__(self, store: JobStore, owner: str, duration: float, clock: Callable[[], float] = time.time):
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
            data = json.loads(path.read_bytes())
        except FileNotFoundError:           # lease files go only with the folder: the job is gone
            return None
        return Lease(job_id, int(data["generation"]), str(data["owner"]), str(data["token"]),
                     float(data["expires_at"]))

    def free(self, job_id: str) -> bool:
        lease = self.current(job_id)
        return lease is None or self.clock() >= lease.expires_at

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
            os.link(temp, folder / lease.name)
        except (FileExistsError, FileNotFoundError):
            return None
        finally:
            temp.unlink(missing_ok=True)
        return lease

    def holds(self, lease: Lease) -> bool:
        """Whether ``lease`` is still the job's lease and runs for a while yet by this replica's clock."""
        if self.clock() >= lease.expires_at - SPARE * self.duration:
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
            write_atomic(self.store.folder(lease.job_id) / lease.name, renewed.encode())
        except FileNotFoundError:
            return None
        return renewed

    def release(self, lease: Lease) -> None:
        """Give the job up now (``expires_at`` 0): any replica may claim it at once."""
        if not self.holds(lease):
            return
        try:
            write_atomic(self.store.folder(lease.job_id) / lease.name, dataclasses.replace(lease, expires_at=0.0).encode())
        except FileNotFoundError:
            return
