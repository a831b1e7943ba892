"""Can the stage's pods mount their job store (spec.jobs.claimName)? A claim that does not exist is refused here,
as Accepted=False JobsStoreMissing naming it, instead of pods that wait Pending on a volume that never comes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stage_operator.api.jobs import Jobs
from stage_operator.capacity import Fit

MISSING = "JobsStoreMissing"
RECHECK_SECONDS = 10.0  # PVCs are not watched: a stage waiting for its claim looks again this often


def check(jobs: Jobs | None, claim: Mapping[str, Any] | None, namespace: str) -> Fit:
    """Fit(True) without spec.jobs or when the claim exists; ``claim``: the PersistentVolumeClaim as read (None:
    not found in the stage's namespace)."""
    if jobs is None or claim is not None:
        return Fit(True)
    return Fit(False, f"spec.jobs.claimName {jobs.claim_name!r}: no PersistentVolumeClaim of that name in namespace "
                      f"{namespace!r}; create it (ReadWriteMany) or change claimName",
               reason=MISSING, waiting=f"waiting for PersistentVolumeClaim {jobs.claim_name}")
