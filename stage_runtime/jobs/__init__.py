"""Video jobs that live beside the replicas, not inside one (docs/http-api.md "Video jobs", docs/job-stores.md).

    store/              where jobs live — torch-free, core-only
        base.py             the interface (JobStore) and the names of a job's files
        filesystem.py       FileJobStore: a folder every replica shares (--job-store DIR)
        file_leases.py        its leases: a file per claim, hard-linked into place
        s3.py               ObjectJobStore: an S3-compatible bucket (--job-store s3://BUCKET/PREFIX)
        s3_leases.py          its leases: conditional writes (If-None-Match, If-Match)
        s3_client.py          the boto3 client, the calls on the bucket and what their errors mean
        s3_sweep.py           its sweep: the due expiries, and an hourly pass for leftovers and stale markers
    record.py           a job's record (the JSON a store keeps) and the OpenAI ``Video`` object it answers as
    lease.py            what a lease is and what every store's leases do (claim, renew, release, SPARE)
    runner.py           which jobs this replica runs: the scan, claims, fencing, hand-off at a drain
    run.py              one job's run under its lease, through the stage's engine
    run_checkpoints.py    its step checkpoints (snapshots between ticks, local copies for the ranks)
    checkpoint_writer.py  the writes, off the step path: one in flight, the newest pending
    routes.py           /v1/videos, as the openai SDK calls it
    form.py               the create request (multipart or JSON), validated at the edge
    content.py            the content answers: byte ranges, presigned redirects

``store/``, ``record`` and ``lease`` are plain data and I/O (the layer ``jobs``); the runner, runs and routes use the
stage's service (the layer ``jobs.service``, which the stage process wires in: tests/test_layers.py).
"""
