"""`spec.jobs`: the video job API's shared store (the filesystem backend: a ReadWriteMany claim) and its timings.

The bounds are the runtime's own (`stage_runtime.config.JobsConfig`), read from its fields, so the CRD never
admits what the stage would refuse at startup. The fields map onto the stage's `jobs:` config
(builders.runtime_config): claimName → `store` (the claim's mount, JOBS_DIR), checkpointEverySteps →
`checkpoint_every_steps`, retentionSeconds → `retention_s`, leaseSeconds → `lease_s`.
"""

from __future__ import annotations

import math

import annotated_types
from pydantic import Field

from stage_operator.api.base import ApiModel
from stage_runtime.config import JobsConfig

DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


def _bounds(field: str) -> dict[str, int]:
    """Whole-second ge/le of a JobsConfig field (gt becomes ge of the next whole number; ge rounds up)."""
    out: dict[str, int] = {}
    for m in JobsConfig.model_fields[field].metadata:
        if isinstance(m, annotated_types.Ge):
            out["ge"] = math.ceil(m.ge)
        elif isinstance(m, annotated_types.Gt):
            out["ge"] = math.floor(m.gt) + 1
        elif isinstance(m, annotated_types.Le):
            out["le"] = math.floor(m.le)
    return out


def _default(field: str) -> int:
    return int(JobsConfig.model_fields[field].default)


class Jobs(ApiModel):
    """The video job store every replica shares (`/v1/videos`): job records, outputs and step checkpoints on a
    ReadWriteMany PersistentVolumeClaim mounted in every pod at /var/lib/diffstage/jobs. Without spec.jobs the
    job routes answer 404 jobs_not_configured. A claim that does not exist is status Accepted=False
    (JobsStoreMissing) and no pod is created until it does."""

    claim_name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN, description=(
        "The PersistentVolumeClaim holding the store, in the stage's namespace. ReadWriteMany when replicas > 1 "
        "(every replica reads and writes every job); mounted read-write. Its files are the stage user's "
        "(fsGroup 65532)."))
    checkpoint_every_steps: int = Field(_default("checkpoint_every_steps"), **_bounds("checkpoint_every_steps"),
                                        description=(
        "A running job's step checkpoint is written after every this many denoising steps (0-10000, default "
        f"{_default('checkpoint_every_steps')}); a replica that takes the job over resumes from the last one. 0: "
        "only when the replica drains."))
    retention_seconds: int = Field(_default("retention_s"), **_bounds("retention_s"), description=(
        "Seconds a finished (completed or failed) job's record and files are kept; they are deleted together "
        f"(1-31536000, default {_default('retention_s')})."))
    lease_seconds: int = Field(_default("lease_s"), **_bounds("lease_s"), description=(
        "A running job's lease, renewed every third of it; a job whose replica stops renewing (pod killed, node "
        f"lost) is taken over by another replica after it (1-3600, default {_default('lease_s')})."))
