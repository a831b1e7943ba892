"""Can the stage's pods reach their job store? A claim (spec.jobs.claimName) or an object store's credentials Secret
(spec.jobs.objectStore.credentialsSecret) that does not exist is refused here, as Accepted=False JobsStoreMissing
naming it, instead of pods that wait Pending on a volume, or fail on an env var, that never comes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stage_operator.api.jobs import Jobs
from stage_operator.capacity import Fit

MISSING = "JobsStoreMissing"
RECHECK_SECONDS = 10.0  # PVCs and Secrets are not watched: a stage waiting for one looks again this often


def check(jobs: Jobs | None, claim: Mapping[str, Any] | None, namespace: str) -> Fit:
    """Fit(True) without spec.jobs or when what it names exists; ``claim``: the PersistentVolumeClaim, or the
    credentials Secret, as read (None: not found in the stage's namespace)."""
    if jobs is None or claim is not None:
        return Fit(True)
    if jobs.object_store is not None:
        secret = jobs.object_store.credentials_secret
        if secret is None:                       # the service account's identity: nothing to wait for
            return Fit(True)
        return Fit(False, f"spec.jobs.objectStore.credentialsSecret {secret!r}: no Secret of that name in namespace "
                          f"{namespace!r}; create it (keys AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) or change "
                          "credentialsSecret", reason=MISSING, waiting=f"waiting for Secret {secret}")
    return Fit(False, f"spec.jobs.claimName {jobs.claim_name!r}: no PersistentVolumeClaim of that name in namespace "
                      f"{namespace!r}; create it (ReadWriteMany) or change claimName",
               reason=MISSING, waiting=f"waiting for PersistentVolumeClaim {jobs.claim_name}")
