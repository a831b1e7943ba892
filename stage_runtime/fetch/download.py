"""A resumable, verified HTTP(S) download of one archive: `download(url, part, sha256)`.

The bytes go to `part` (a `.part` file next to where the archive is wanted). A `part` left by an earlier
attempt is resumed with `Range: bytes=N-` (a server that answers 200 instead of 206 starts it over); a
connection that breaks mid-way is resumed the same way, up to `attempts` times. The SHA-256 covers the
whole file, the resumed prefix included; a mismatch removes `part` (the next attempt starts clean) and
raises ChecksumMismatchError naming both digests. Standard library only (urllib): it runs in an init
container before anything heavy is imported.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from stage_runtime.errors import ChecksumMismatchError, ModelFetchError

log = logging.getLogger(__name__)
CHUNK = 1 << 20
TIMEOUT_S = 30.0        # per socket operation, not for the whole download
ATTEMPTS = 4
RETRY_PAUSE_S = 0.5


@dataclass(frozen=True)
class Downloaded:
    path: Path
    size: int
    requests: int          # HTTP requests made (1 for a clean download)
    resumed_from: int      # bytes already on disk when the first request went out


def _hash_prefix(path: Path) -> tuple[hashlib._Hash, int]:
    digest, size = hashlib.sha256(), 0
    if path.exists():
        with path.open("rb") as f:
            while block := f.read(CHUNK):
                digest.update(block)
                size += len(block)
    return digest, size


def _request(url: str, offset: int) -> urllib.request.Request:
    headers = {"User-Agent": "diffstage-fetch-model/1", "Accept-Encoding": "identity"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    return urllib.request.Request(url, headers=headers)


def _one_request(url: str, part: Path, digest: hashlib._Hash, offset: int) -> tuple[hashlib._Hash, int]:
    """Append what the server sends to `part`; the (digest, size) reached. A transfer that breaks raises
    _Broken with the progress (kept on disk) so the caller can resume."""
    try:
        response = urllib.request.urlopen(_request(url, offset), timeout=TIMEOUT_S)  # noqa: S310 (scheme checked)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and offset:          # nothing left past what we have: verify what is there
            return digest, offset
        raise ModelFetchError(f"GET {url}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ModelFetchError(f"GET {url}: {getattr(exc, 'reason', exc)}") from None
    with response:
        if offset and response.status != 206:   # the server ignored the range: start over
            log.info("%s: the server does not resume (HTTP %d): downloading from the start", url, response.status)
            digest, offset = hashlib.sha256(), 0
        length, received = response.headers.get("Content-Length"), 0
        with part.open("ab" if offset else "wb") as out:
            try:
                while block := response.read(CHUNK):
                    out.write(block)
                    digest.update(block)
                    received += len(block)
            except (OSError, ValueError) as exc:  # a reset, a timeout, an incomplete read
                raise _Broken(digest, offset + received, f"GET {url}: broke after {offset + received} bytes: "
                                                         f"{exc!r}") from None
    if length is not None and received != int(length):
        raise _Broken(digest, offset + received, f"GET {url}: got {received} of {length} bytes")
    return digest, offset + received


class _Broken(ModelFetchError):
    def __init__(self, digest: hashlib._Hash, size: int, message: str):
        super().__init__(message)
        self.digest, self.size = digest, size


def download(url: str, part: Path, sha256: str, attempts: int = ATTEMPTS) -> Downloaded:
    """Download `url` into `part` (resuming what is there) and verify it; returns the verified file."""
    part.parent.mkdir(parents=True, exist_ok=True)
    digest, size = _hash_prefix(part)
    resumed_from, requests = size, 0
    while True:
        requests += 1
        try:
            digest, size = _one_request(url, part, digest, size)
            break
        except _Broken as exc:
            digest, size = exc.digest, exc.size
            if requests >= attempts:
                raise ModelFetchError(f"{exc} (gave up after {requests} requests; the part is kept for a resume)") \
                    from None
            log.warning("%s; resuming at byte %d", exc, size)
            time.sleep(RETRY_PAUSE_S)
    got = digest.hexdigest()
    if got != sha256:
        os.unlink(part)
        raise ChecksumMismatchError(f"{url}: sha256 of the {size}-byte download is {got}, but --sha256 "
                                    f"(spec.model.source.uri.sha256) is {sha256}")
    return Downloaded(part, size, requests, resumed_from)
