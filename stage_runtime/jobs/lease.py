"""Which replica runs a job: a lease it renews, and another replica takes once it expires. The lease and what every
store's leases do (``jobs.store.file_leases``, ``jobs.store.s3_leases`` implement it).

The owner renews its lease every third of it, and only while the lease still runs by its own clock with a tenth of
it to spare (``SPARE``): a replica whose renewals stopped (killed, partitioned, its loop stalled, its store out of
reach) never renews after another could have claimed. Replicas' clocks must agree within that tenth (NTP does).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

SPARE = 0.1              # of the lease: the owner stops renewing this long before it ends


@dataclass(frozen=True)
class Lease:
    job_id: str
    generation: int          # claims of the job so far: each claim (a first one, a takeover) is the next
    owner: str               # the replica (host-pid), for people
    token: str               # this claim (a replica restarted with the same name is another owner)
    expires_at: float        # wall-clock seconds; 0: released
    version: str = ""        # the store's version of the lease as this replica last wrote it (an object's ETag)

    def encode(self) -> bytes:
        return json.dumps({k: v for k, v in dataclasses.asdict(self).items()
                           if k not in ("job_id", "version")}).encode()

    @classmethod
    def decode(cls, job_id: str, data: bytes, version: str = "") -> Lease:
        fields = json.loads(data)
        return cls(job_id, int(fields["generation"]), str(fields["owner"]), str(fields["token"]),
                   float(fields["expires_at"]), version)


class Leases(Protocol):
    owner: str
    duration: float
    clock: Callable[[], float]

    def current(self, job_id: str) -> Lease | None:
        """The job's lease, or None: never claimed, or the job is gone."""

    def free(self, job_id: str) -> bool:
        """Whether the job may be claimed now (:func:`free`)."""

    def claim(self, job_id: str) -> Lease | None:
        """This replica's lease on the job, or None: another holds a live lease, won the claim, or the job is gone.
        Of any number of replicas claiming at once, exactly one wins."""

    def holds(self, lease: Lease) -> bool:
        """Whether ``lease`` is still the job's lease and runs for a while yet by this replica's clock."""

    def renew(self, lease: Lease) -> Lease | None:
        """The lease extended by ``duration`` from now, or None: it is lost and the run must stop."""

    def release(self, lease: Lease) -> None:
        """Give the job up now: any replica may claim it at once."""


def free(leases: Leases, job_id: str) -> bool:
    """Whether the job may be claimed now (never claimed, released, or expired)."""
    lease = leases.current(job_id)
    return lease is None or leases.clock() >= lease.expires_at


def usable(leases: Leases, lease: Lease) -> bool:
    """Whether ``lease`` still runs by this replica's clock with its spare tenth left."""
    return leases.clock() < lease.expires_at - SPARE * leases.duration
