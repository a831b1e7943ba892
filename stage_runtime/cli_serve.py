"""The flags only ``stage-runtime serve`` takes: how the process listens, is keyed, limits uploads, keeps video
jobs and serves the playground (the engine's flags, which generate and validate take too, are ``cli``'s)."""

from __future__ import annotations

import argparse
import os


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="listen address (default 0.0.0.0)")
    p.add_argument("--http-port", type=int, help="HTTP port (default 8000; 0: any free port)")
    p.add_argument("--zmq-port", type=int, help="ZMQ ROUTER port (default 5570; 0: any free port)")
    p.add_argument("--drain-timeout", type=float, help="SIGTERM grace for in-flight requests, seconds (default 25)")
    p.add_argument("--startup-timeout", type=float, help="ready within this many seconds of the start, or exit 1 "
                                                       "with StartupTimeout naming the phase (default: no limit)")
    p.add_argument("--termination-log", help="where the one-line failure reason goes "
                                           "(default /dev/termination-log when it exists)")
    p.add_argument("--api-key-file", default=os.environ.get("DIFFSTAGE_API_KEYS") or None,
                   help="file of API keys, one a line: every /v1/* route then needs 'Authorization: Bearer KEY' "
                        "(default: $DIFFSTAGE_API_KEYS; none: no keys)")
    p.add_argument("--max-upload-bytes", type=int, help="largest multipart edit body (default 16 MiB; more: 413)")
    p.add_argument("--max-image-pixels", type=int,
                   help="largest image uploaded or requested, in pixels (default 4096*4096)")
    p.add_argument("--job-store", metavar="DIR|s3://BUCKET/PREFIX", help="where every replica keeps the /v1/videos "
                   "jobs: a shared folder or an S3-compatible bucket (default: none, the job API is off)")
    p.add_argument("--job-store-endpoint", metavar="URL", help="an S3-compatible server (MinIO, R2, Ceph RGW…)")
    p.add_argument("--job-store-region", help="the bucket's region (default: from the AWS environment)")
    p.add_argument("--job-presigned-content", action="store_true", default=None,
                   help="content answers redirect to a presigned URL of the object store")
    p.add_argument("--job-retention-s", type=float, help="a finished job is deleted this long after (default 86400)")
    p.add_argument("--job-lease-s", type=float, help="a job's lease; another replica takes it on expiry (default 30)")
    p.add_argument("--job-checkpoint-every-steps", type=int,
                   help="a running job's checkpoint every this many steps (default 5; 0: only at a drain)")
    p.add_argument("--no-playground", dest="playground", action="store_false", default=None,
                   help="serve no page at / (default: the playground page, over this stage's own API)")
