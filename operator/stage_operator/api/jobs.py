"""`spec.jobs`: the video job API's shared store — a ReadWriteMany claim (the folder store) or an S3-compatible
bucket (`objectStore`) — and its timings.

The bounds are the runtime's own (`stage_runtime.config.JobsConfig`), read from its fields, so the CRD never
admits what the stage would refuse at startup. The fields map onto the stage's `jobs:` config
(builders.runtime_config): claimName → `store` (the claim's mount, JOBS_DIR); objectStore → `store`
(s3://bucket/prefix), `endpoint`, `region`, presignedContent → `presigned_content`; checkpointEverySteps →
`checkpoint_every_steps`, retentionSeconds → `retention_s`, leaseSeconds → `lease_s`.
"""

from __future__ import annotations

import math

import annotated_types
from pydantic import ConfigDict, Field, model_validator

from stage_operator.api.base import ApiModel, cel, check_exactly_one, exactly_one
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


BUCKET = r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"
PREFIX = r"^[^/\s][^\s]{0,511}$"
ENDPOINT = r"^https?://[^\s/]+(/\S*)?$"
REGION = r"^[a-z0-9-]{1,32}$"
PRESIGN_NEEDS_OBJECTS = "jobs.presignedContent needs jobs.objectStore: a claim has no URL to redirect to"
# the keys of objectStore.credentialsSecret the stage reads (the standard AWS environment); the token is optional
CREDENTIAL_KEYS = (("AWS_ACCESS_KEY_ID", False), ("AWS_SECRET_ACCESS_KEY", False), ("AWS_SESSION_TOKEN", True))


class ObjectStore(ApiModel):
    """An S3-compatible bucket holding the store (AWS S3, MinIO, R2, Ceph RGW, GCS's S3 API; docs/job-stores.md)."""

    bucket: str = Field(min_length=3, max_length=63, pattern=BUCKET, description=(
        "The bucket (3-63 of a-z 0-9 . -, starting and ending with a letter or digit). It must exist; the stage "
        "needs s3:GetObject, s3:PutObject, s3:DeleteObject on the prefix and s3:ListBucket on the bucket."))
    prefix: str = Field("", max_length=512, pattern=r"^$|" + PREFIX, description=(
        "The key prefix of this stage's jobs (no leading slash; default: the bucket's root). Stages sharing a "
        "bucket use different prefixes."))
    endpoint: str | None = Field(None, max_length=2048, pattern=ENDPOINT, description=(
        "An S3-compatible server's URL (http:// or https://); unset: AWS S3."))
    region: str | None = Field(None, max_length=32, pattern=REGION, description="The bucket's region.")
    credentials_secret: str | None = Field(None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN, description=(
        "A Secret in the stage's namespace whose keys AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and optionally "
        "AWS_SESSION_TOKEN) become the stage's environment. Unset: the pod's own AWS identity, found by the SDK's "
        "credential chain (IRSA or EKS Pod Identity through podTemplate.serviceAccountName, a web identity token). A Secret that does not exist is status Accepted=False "
        "(JobsStoreMissing)."))

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


class Jobs(ApiModel):
    """The video job store every replica shares (`/v1/videos`): job records, outputs and step checkpoints, on a
    ReadWriteMany PersistentVolumeClaim mounted in every pod at /var/lib/diffstage/jobs (claimName) or in an
    S3-compatible bucket (objectStore) — exactly one of them. Without spec.jobs the job routes answer 404
    jobs_not_configured. A claim (or credentials Secret) that does not exist is status Accepted=False
    (JobsStoreMissing) and no pod is created until it does."""

    model_config = ConfigDict(**ApiModel.model_config, json_schema_extra={"x-kubernetes-validations": [
        exactly_one(("claimName", "objectStore"), "jobs"),
        cel("!has(self.presignedContent) || !self.presignedContent || has(self.objectStore)",
            f"'{PRESIGN_NEEDS_OBJECTS}'")]})

    claim_name: str | None = Field(None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN, description=(
        "The PersistentVolumeClaim holding the store, in the stage's namespace. ReadWriteMany when replicas > 1 "
        "(every replica reads and writes every job); mounted read-write. Its files are the stage user's "
        "(fsGroup 65532)."))
    object_store: ObjectStore | None = Field(None, description=(
        "An S3-compatible bucket holding the store instead of a claim (docs/job-stores.md: which to choose)."))
    presigned_content: bool | None = Field(None, description=(
        "objectStore only: GET /v1/videos/{id}/content answers a 307 redirect to a presigned URL of the bucket "
        "instead of streaming the bytes through the stage (clients must reach the endpoint)."))
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

    @model_validator(mode="after")
    def _one_store(self) -> Jobs:
        check_exactly_one(self, ("claim_name", "object_store"), "jobs")
        if self.presigned_content and self.object_store is None:
            raise ValueError(PRESIGN_NEEDS_OBJECTS)
        return self
