"""The video job API's store and its timings (part of :mod:`stage_runtime.config`; docs/http-api.md "Video jobs").

``store`` is where every replica of the stage keeps the jobs — their records, output files, checkpoints and the
leases that say which replica runs which job: a folder they share (a ReadWriteMany volume in Kubernetes), or an
S3-compatible bucket, ``s3://BUCKET/PREFIX`` (``endpoint`` for a server other than AWS's: MinIO, R2, Ceph RGW, GCS's
S3 API; credentials from the standard AWS environment variables and files). Without it the ``/v1/videos`` job routes
answer 404 ``jobs_not_configured``. The timings are the lease's (how long a replica may stop renewing before
another one takes its job), the retention of a finished job (its record and files go together), the poll
interval the answers suggest to clients, how often a replica looks for work in the store, and how often a running
job's step checkpoint is written.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

S3_URL = re.compile(r"^s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?:/(.*))?$")     # the bucket naming rules, a prefix


class JobsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    store: str | None = Field(None, min_length=1)       # a shared folder or s3://BUCKET/PREFIX; None: the job API is off
    endpoint: str | None = Field(None, pattern=r"^https?://[^\s/]+(/\S*)?$")   # an S3-compatible server's URL
    region: str | None = Field(None, pattern=r"^[a-z0-9-]{1,32}$")
    # GET /v1/videos/{id}/content redirects (307) to a presigned URL of the object store instead of streaming it.
    presigned_content: bool = False
    presign_expiry_s: int = Field(900, ge=1, le=7 * 86400)
    # A finished (completed or failed) job's record and files are deleted this long after it finished.
    retention_s: float = Field(86400.0, gt=0, le=365 * 86400, allow_inf_nan=False)
    # A claimed job's lease: renewed every lease_s / 3; a job whose owner stops renewing is free after it.
    lease_s: float = Field(30.0, ge=0.5, le=3600, allow_inf_nan=False)
    # The openai-poll-after-ms header of every job answer (the SDK's poll() waits this long between GETs).
    poll_after_ms: int = Field(1000, ge=10, le=600_000)
    # How often a replica looks in the store for queued jobs, expired leases and expired jobs.
    scan_interval_s: float = Field(2.0, gt=0, le=600, allow_inf_nan=False)
    # A job whose run ended for a reason not its own (drain, dead engine, a lost lease) runs again, at most
    # this many runs in all; then it fails.
    max_attempts: int = Field(3, ge=1, le=100)
    # While a job denoises, its owner writes its step checkpoint (jobs/<id>/checkpoint.safetensors) after every
    # this many steps; a replica that takes the job over resumes from it. 0: only when the replica drains.
    checkpoint_every_steps: int = Field(5, ge=0, le=10_000)

    @field_validator("store")
    @classmethod
    def _store_url(cls, value: str | None) -> str | None:
        if value is not None and value.startswith("s3:") and not S3_URL.match(value):
            raise ValueError("must be s3://BUCKET/PREFIX with a valid bucket name (3-63 of a-z 0-9 . -)")
        if value is not None and "://" in value and not value.startswith("s3://"):
            raise ValueError("must be a folder or s3://BUCKET/PREFIX (no other scheme is served)")
        return value

    @model_validator(mode="after")
    def _object_store_options(self) -> JobsConfig:
        s3 = self.store is not None and self.store.startswith("s3://")
        for name in ("endpoint", "region"):
            if getattr(self, name) is not None and not s3:
                raise ValueError(f"jobs.{name} is for an object store (jobs.store=s3://BUCKET/PREFIX); "
                                 f"jobs.store={self.store!r}")
        if self.presigned_content and not s3:
            raise ValueError("jobs.presigned_content needs an object store (jobs.store=s3://BUCKET/PREFIX): a folder "
                             "has no URL to redirect to")
        return self

    @model_validator(mode="after")
    def _scan_within_lease(self) -> JobsConfig:
        if self.scan_interval_s > self.lease_s * 10:
            raise ValueError(f"scan_interval_s={self.scan_interval_s:g} must be at most 10 × lease_s "
                             f"({self.lease_s:g}): an expired lease would wait too long for a taker")
        return self
