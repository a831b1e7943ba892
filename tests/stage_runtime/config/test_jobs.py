"""The ``jobs`` section of the stage config: off without a store, its bounds named, the serve flags onto it."""

from __future__ import annotations

import pytest

from stage_runtime.cli import build_parser, config_from_args
from stage_runtime.config import ConfigError, load_config


def test_the_job_api_is_off_by_default_with_a_day_of_retention_a_30_s_lease_and_a_checkpoint_every_5_steps():
    jobs = load_config({"model": {"path": "/m"}}).jobs
    assert (jobs.store, jobs.retention_s, jobs.lease_s, jobs.poll_after_ms, jobs.scan_interval_s, jobs.max_attempts,
            jobs.checkpoint_every_steps) == (None, 86400.0, 30.0, 1000, 2.0, 3, 5)


@pytest.mark.parametrize(("jobs", "named"), [
    ({"store": ""}, "jobs.store=''"), ({"retention_s": 0}, "jobs.retention_s=0"), ({"lease_s": 0.1}, "jobs.lease_s=0.1"),
    ({"poll_after_ms": 1}, "jobs.poll_after_ms=1"), ({"max_attempts": 0}, "jobs.max_attempts=0"),
    ({"checkpoint_every_steps": -1}, "jobs.checkpoint_every_steps=-1"),
    ({"lease_s": 1, "scan_interval_s": 60}, "scan_interval_s=60 must be at most 10 × lease_s"),
    ({"stor": "/x"}, "unknown field jobs.stor"),
    ({"store": "s3://My_Bucket/jobs"}, "jobs.store='s3://My_Bucket/jobs'"),
    ({"store": "gs://bucket/jobs"}, "no other scheme is served"),
    ({"store": "/x", "endpoint": "http://minio:9000"}, "jobs.endpoint is for an object store"),
    ({"store": "/x", "presigned_content": True}, "jobs.presigned_content needs an object store"),
    ({"store": "s3://b-1/x", "endpoint": "minio:9000"}, "jobs.endpoint='minio:9000'"),
    ({"store": "s3://b-1/x", "region": "EU West"}, "jobs.region='EU West'"),
])
def test_a_bad_jobs_field_is_named(jobs, named):
    with pytest.raises(ConfigError) as refused:
        load_config({"model": {"path": "/m"}, "jobs": jobs})
    assert named in str(refused.value)


def test_the_serve_flags_set_the_store_the_retention_the_lease_and_the_checkpoint_interval():
    args = build_parser().parse_args(["serve", "--model", "/m", "--job-store", "/shared/jobs", "--job-retention-s",
                                      "3600", "--job-lease-s", "10", "--job-checkpoint-every-steps", "0"])
    jobs = config_from_args(args).jobs
    assert (jobs.store, jobs.retention_s, jobs.lease_s, jobs.checkpoint_every_steps) == ("/shared/jobs", 3600.0, 10.0, 0)


def test_the_serve_flags_set_an_object_store_its_endpoint_region_and_presigned_content():
    args = build_parser().parse_args(["serve", "--model", "/m", "--job-store", "s3://video-jobs/stage-a",
                                      "--job-store-endpoint", "http://127.0.0.1:9000", "--job-store-region", "eu-west-1",
                                      "--job-presigned-content"])
    jobs = config_from_args(args).jobs
    assert (jobs.store, jobs.endpoint, jobs.region, jobs.presigned_content, jobs.presign_expiry_s) == (
        "s3://video-jobs/stage-a", "http://127.0.0.1:9000", "eu-west-1", True, 900)
