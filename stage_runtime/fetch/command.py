"""``stage-runtime fetch-model URL DIR --sha256 HEX [--cache DIR] [--max-bytes N]``.

Exit codes: 0 the pipeline is at DIR (one JSON line on stdout says what happened); 2 bad input (a
malformed digest or URL, an archive that is not a diffusers pipeline) — permanent; 4 the fetch failed
(network, HTTP status, checksum mismatch) — worth a retry. Before a non-zero exit one line
``Reason: message`` (ConfigError, FetchFailed, ChecksumMismatch) goes to ``--termination-log`` (default
/dev/termination-log when it exists), which the operator shows as the replica's lastFailure.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from stage_runtime.errors import ChecksumMismatchError, ConfigError, ModelFetchError

EXIT_OK, EXIT_CONFIG, EXIT_FETCH = 0, 2, 4
DEFAULT_TERMINATION_LOG = "/dev/termination-log"


class FetchArgs(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    url: str
    dir: str = Field(min_length=1)
    sha256: str
    cache: str | None = Field(None, min_length=1)
    max_bytes: int | None = Field(None, ge=1)

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str) -> str:
        if not v.startswith(("https://", "http://")):
            raise ValueError("must be an http:// or https:// URL")
        return v

    @field_validator("sha256")
    @classmethod
    def _digest(cls, v: str) -> str:
        v = v.strip().lower().removeprefix("sha256:")
        if len(v) != 64 or any(c not in "0123456789abcdef" for c in v):
            raise ValueError("must be 64 hex digits (the SHA-256 of the archive)")
        return v


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fetch-model", help="download a model archive, verify it and unpack it (init containers)")
    p.add_argument("url", help="http(s) URL of a tar, tar.gz or zip of a diffusers pipeline folder")
    p.add_argument("dir", help="where the pipeline folder goes (a link into the cache with --cache)")
    p.add_argument("--sha256", required=True, help="SHA-256 of the archive (64 hex digits)")
    p.add_argument("--cache", help="node-local cache folder: store by digest, reuse, evict")
    p.add_argument("--max-bytes", type=int, help="keep the cache under this many bytes (LRU; models in use stay)")
    p.add_argument("--termination-log", help="where the one-line failure reason goes")
    p.set_defaults(func=run)


def _fail(path: str | None, reason: str, message: str, code: int) -> int:
    """The one-line ``Reason: message`` the kubelet keeps (4 KiB at most), as the stage writes it."""
    line = f"{reason}: {' '.join(message.split())}".encode()[:4096].decode(errors="ignore")
    path = path or (DEFAULT_TERMINATION_LOG if os.path.exists(DEFAULT_TERMINATION_LOG) else None)
    if path is not None:
        try:
            Path(path).write_text(line + "\n", encoding="utf-8")
        except OSError as exc:
            print(f"cannot write the termination log {path}: {exc}", file=sys.stderr)
    print(f"error: {line}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    from stage_runtime.fetch.model import fetch_model

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        req = FetchArgs(url=args.url, dir=args.dir, sha256=args.sha256, cache=args.cache, max_bytes=args.max_bytes)
    except ValidationError as exc:
        message = "; ".join(f"{'.'.join(map(str, e['loc']))}={e.get('input')!r}: "
                            f"{e['msg'].removeprefix('Value error, ')}" for e in exc.errors(include_url=False))
        return _fail(args.termination_log, "ConfigError", f"fetch-model: {message}", EXIT_CONFIG)
    try:
        fetched = fetch_model(req.url, req.dir, req.sha256, req.cache, req.max_bytes)
    except ChecksumMismatchError as exc:
        return _fail(args.termination_log, "ChecksumMismatch", str(exc), EXIT_FETCH)
    except ModelFetchError as exc:
        return _fail(args.termination_log, "FetchFailed", str(exc), EXIT_FETCH)
    except ConfigError as exc:
        return _fail(args.termination_log, "ConfigError", f"{req.url}: {exc}", EXIT_CONFIG)
    except OSError as exc:  # a full disk, a read-only cache: the node's problem, worth a retry elsewhere
        return _fail(args.termination_log, "FetchFailed", f"{req.url}: {exc}", EXIT_FETCH)
    print(json.dumps(fetched.wire()))
    return EXIT_OK
