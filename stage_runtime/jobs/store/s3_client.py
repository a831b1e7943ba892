"""The object store's client: one boto3 S3 client per store (thread-safe, shared by every thread of the stage), and
what its errors mean to the job store.

boto3 is the AWS SDK: it reads credentials the standard way (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
``AWS_SESSION_TOKEN``, the shared files, IRSA and EKS pod identity's web identity token, instance metadata), signs
presigned URLs, and sends S3's conditional writes (``IfNoneMatch``, ``IfMatch`` on PutObject) that the leases need.
Timeouts are short and retries few, so a store out of reach fails a call within seconds (``JobStoreError``: the
HTTP answer is a 503 with Retry-After; a run tries its writes again while its lease runs) instead of hanging it.

    Missing      the object is not there (NoSuchKey, 404)
    Conflict     a conditional write lost (412 PreconditionFailed, 409 ConditionalRequestConflict)
    JobStoreError  anything else: refused credentials, a missing bucket, the server out of reach or failing
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from stage_runtime.errors import JobStoreError

CONNECT_TIMEOUT_S, READ_TIMEOUT_S, ATTEMPTS = 2.0, 3.0, 2
MISSING_CODES = {"NoSuchKey", "404", "NotFound"}
CONFLICT_CODES = {"PreconditionFailed", "ConditionalRequestConflict", "412", "409"}


class Missing(Exception):
    """The object is not there."""


class Conflict(Exception):
    """A conditional write lost: the object changed (or appeared) since this replica read it."""


def make_client(endpoint: str | None, region: str | None) -> Any:
    import boto3
    from botocore.config import Config

    config = Config(connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S,
                    retries={"total_max_attempts": ATTEMPTS, "mode": "standard"}, signature_version="s3v4",
                    s3={"addressing_style": "path" if endpoint else "auto"},
                    request_checksum_calculation="when_required", response_checksum_validation="when_required")
    region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return boto3.session.Session().client("s3", endpoint_url=endpoint, region_name=region, config=config)


def call(location: str, what: str, method: Callable[..., Any], **params: Any) -> Any:
    """``method(**params)`` with its failures as Missing, Conflict or JobStoreError (naming the store and the key)."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return method(**params)
    except ClientError as exc:
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        if code in MISSING_CODES or (status == "404" and code != "NoSuchBucket"):
            raise Missing(what) from None
        if code in CONFLICT_CODES or status in ("412", "409"):
            raise Conflict(what) from None
        raise JobStoreError(f"job store {location}: {what}: {code or status} {error.get('Message', '')}".rstrip()) \
            from None
    except BotoCoreError as exc:
        raise JobStoreError(f"job store {location}: {what}: {exc}") from None
