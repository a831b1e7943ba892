"""The video job API's store and its timings (part of :mod:`stage_runtime.config`; docs/http-api.md "Video jobs").

``store`` is a folder every replica of the stage shares (a ReadWriteMany volume in Kubernetes): the job records,
their output files and the leases that say which replica runs which job. Without it the ``/v1/videos`` job routes
answer 404 ``jobs_not_configured``. The timings are the lease's (how long a replica may stop renewing before
another one takes its job), the retention of a finished job (its record and files go together), the poll
interval the answers suggest to clients, how often a replica looks for work in the store, and how often a running
job's step checkpoint is written.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class JobsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    store: str | None = Field(None, min_length=1)       # the shared folder; None: the job API is off
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

    @model_validator(mode="after")
    def _scan_within_lease(self) -> JobsConfig:
        if self.scan_interval_s > self.lease_s * 10:
            raise ValueError(f"scan_interval_s={self.scan_interval_s:g} must be at most 10 × lease_s "
                             f"({self.lease_s:g}): an expired lease would wait too long for a taker")
        return self
