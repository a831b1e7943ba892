"""The object store's bucket: one boto3 S3 client per store (thread-safe, shared by every thread of the stage), the
calls the job store makes on the bucket, and what their errors mean to it.

boto3 is the AWS SDK: it reads credentials the standard way (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
``AWS_SESSION_TOKEN``, the shared files, IRSA and EKS pod identity's web identity token, instance metadata), signs
presigned URLs, and sends S3's conditional writes (``IfNoneMatch``, ``IfMatch`` on PutObject) that the leases need.
Timeouts are short and retries few (a call gives up within ~7 s on a server that accepts connections and never
answers, at once on one that refuses them), so a store out of reach fails a call as ``JobStoreError`` (the HTTP
answer is a 503 with Retry-After; a run tries its writes again while its lease runs) instead of hanging it, and a
lease renewal fails well inside the tenth of the lease it has to spare.

    Missing        the object is not there (NoSuchKey, 404)
    Conflict       a conditional write lost (412 PreconditionFailed, 409 ConditionalRequestConflict)
    JobStoreError  anything else: refused credentials, a missing bucket, the server out of reach or failing; the
                   message names the store (``s3://bucket/prefix at endpoint``) and the key

A write whose answer was lost is sent again by botocore; a conditional one then meets the object it wrote itself
and gets 412. Callers that need to know tell their own write by its content (``ObjectJobStore.create``,
``ObjectLeases``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

from stage_runtime.errors import JobStoreError

CONNECT_TIMEOUT_S, READ_TIMEOUT_S, ATTEMPTS = 2.0, 3.0, 2
MISSING_CODES = {"NoSuchKey", "404", "NotFound"}
CONFLICT_CODES = {"PreconditionFailed", "ConditionalRequestConflict", "412", "409"}
DELETE_BATCH = 1000                 # keys per DeleteObjects call (S3's limit)

_loader_lock = threading.Lock()
_loader: Any = None


class Missing(Exception):
    """The object is not there."""


class Conflict(Exception):
    """A conditional write lost: the object changed (or appeared) since this replica read it."""


def _session() -> Any:
    """A boto3 session of its own (credentials resolved per store) whose service descriptions are loaded once per
    process: parsing botocore's S3 model again for every client would cost ~70 ms a store."""
    import boto3
    import botocore.session

    global _loader
    core = botocore.session.Session()
    with _loader_lock:
        if _loader is None:
            _loader = core.get_component("data_loader")
        else:
            core.register_component("data_loader", _loader)
    return boto3.session.Session(botocore_session=core)


def make_client(endpoint: str | None, region: str | None) -> Any:
    from botocore.config import Config

    config = Config(connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S,
                    retries={"total_max_attempts": ATTEMPTS, "mode": "standard"}, signature_version="s3v4",
                    s3={"addressing_style": "path" if endpoint else "auto"},
                    request_checksum_calculation="when_required", response_checksum_validation="when_required")
    region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return _session().client("s3", endpoint_url=endpoint, region_name=region, config=config)


class Bucket:
    """The calls on one bucket, each failure as Missing, Conflict or JobStoreError naming ``location`` and the key."""

    def __init__(self, name: str, location: str, client: Any):
        self.name, self.location, self.client = name, location, client

    def call(self, what: str, method: str, **params: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self.client, method)(Bucket=self.name, **params)
        except ClientError as exc:
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
            if code in MISSING_CODES or (status == "404" and code != "NoSuchBucket"):
                raise Missing(what) from None
            if code in CONFLICT_CODES or status in ("412", "409"):
                raise Conflict(what) from None
            raise JobStoreError(f"job store {self.location}: {what}: {code or status} "
                                f"{error.get('Message', '')}".rstrip()) from None
        except BotoCoreError as exc:
            raise JobStoreError(f"job store {self.location}: {what}: {exc}") from None

    def write(self, key: str, data: bytes, **conditions: str) -> str:
        """One PUT, whole or not at all (``conditions``: IfNoneMatch / IfMatch); the new object's ETag."""
        return self.call(f"cannot write {key}", "put_object", Key=key, Body=data, **conditions)["ETag"]

    def read(self, key: str) -> tuple[bytes, str]:
        """The object's bytes and ETag; Missing when it is not there."""
        answer = self.call(f"cannot read {key}", "get_object", Key=key)
        with answer["Body"] as body:
            return body.read(), answer["ETag"]

    def head(self, key: str) -> dict[str, Any]:
        """The object's metadata (ETag, ContentLength); Missing when it is not there."""
        return self.call(f"cannot read {key}", "head_object", Key=key)

    def delete(self, key: str) -> None:
        """The object gone (deleting a missing one is no error on S3)."""
        self.call(f"cannot delete {key}", "delete_object", Key=key)

    def delete_keys(self, keys: list[str]) -> None:
        """Every one of ``keys`` gone, a thousand per call; JobStoreError naming the first key the server kept."""
        for start in range(0, len(keys), DELETE_BATCH):
            batch = keys[start:start + DELETE_BATCH]
            answer = self.call(f"cannot delete {len(batch)} objects from {batch[0]} on", "delete_objects",
                               Delete={"Objects": [{"Key": key} for key in batch], "Quiet": True})
            kept = answer.get("Errors") or []
            if kept:
                first = kept[0]
                raise JobStoreError(f"job store {self.location}: cannot delete {first.get('Key')} (and "
                                    f"{len(kept) - 1} more): {first.get('Code', '')} {first.get('Message', '')}")

    def keys(self, prefix: str, start_after: str | None = None, limit: int | None = None,
             delimiter: str | None = None) -> Iterator[str]:
        """Keys (or, with ``delimiter``, the common prefixes) under ``prefix`` in order, after ``start_after``."""
        params: dict[str, Any] = {"Prefix": prefix}
        if start_after:
            params["StartAfter"] = start_after
        if delimiter:
            params["Delimiter"] = delimiter
        seen = 0
        while True:
            if limit is not None:
                params["MaxKeys"] = max(1, min(1000, limit - seen))
            page = self.call(f"cannot list {prefix}", "list_objects_v2", **params)
            names = [p["Prefix"] for p in page.get("CommonPrefixes", ())] if delimiter else \
                [o["Key"] for o in page.get("Contents", ())]
            for name in names:
                yield name
                seen += 1
                if limit is not None and seen >= limit:
                    return
            if not page.get("IsTruncated"):
                return
            params["ContinuationToken"] = page["NextContinuationToken"]

    def objects(self, prefix: str) -> Iterator[tuple[str, float]]:
        """(key, last modified as epoch seconds) of every object under ``prefix``, in key order."""
        params: dict[str, Any] = {"Prefix": prefix}
        while True:
            page = self.call(f"cannot list {prefix}", "list_objects_v2", **params)
            for item in page.get("Contents", ()):
                yield item["Key"], item["LastModified"].timestamp()
            if not page.get("IsTruncated"):
                return
            params["ContinuationToken"] = page["NextContinuationToken"]
