"""Deliver one model archive as a pipeline folder: download (resumable) → verify → unpack → atomic rename.

Without a cache the pipeline becomes `dest` itself. With one it is stored by digest in the cache (a
second pod on the node, or a restarted one, finds it there and downloads nothing) and `dest` becomes a
symbolic link to it, replaced atomically; then the cache is evicted down to `max_bytes`. A pipeline
folder carries `.diffstage-digest`, so a rerun in the same pod (an emptyDir survives a container restart)
reuses a complete `dest` and refuses one holding another model.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from stage_runtime.errors import ConfigError
from stage_runtime.fetch.archive import extract, folder_bytes
from stage_runtime.fetch.cache import ModelCache
from stage_runtime.fetch.download import download

DIGEST_FILE = ".diffstage-digest"


@dataclass(frozen=True)
class Fetched:
    digest: str
    path: str                  # the pipeline folder (in the cache when there is one)
    size_bytes: int
    downloaded: bool           # False: reused (cache hit, or dest already complete)
    requests: int              # HTTP requests made
    seconds: float
    evicted: list[str] = field(default_factory=list)

    def wire(self) -> dict:
        return asdict(self)


def _unpack(archive: Path, scratch: Path, digest: str) -> Path:
    """The pipeline folder unpacked under `scratch`, stamped with its digest."""
    root = extract(archive, scratch)
    (root / DIGEST_FILE).write_text(digest + "\n")
    return root


def _complete(folder: Path, digest: str) -> bool:
    stamp = folder / DIGEST_FILE
    return stamp.is_file() and stamp.read_text().strip() == digest


def _fetch_into(url: str, dest: Path, digest: str) -> tuple[bool, int]:
    """No cache: dest is the pipeline folder. (downloaded, requests)."""
    if dest.is_dir() and not dest.is_symlink():
        if _complete(dest, digest):
            return False, 0
        raise ConfigError(f"{dest} exists and does not hold the model with sha256 {digest}: give a new folder")
    part = dest.parent / f".{dest.name}.{digest[:16]}.part"
    got = download(url, part, digest)
    scratch = dest.parent / f".{dest.name}.{digest[:16]}.unpack"
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        os.rename(_unpack(part, scratch, digest), dest)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    part.unlink()
    return True, got.requests


def _fetch_cached(url: str, cache: ModelCache, digest: str) -> tuple[bool, int]:
    with cache.fetching(digest):
        if cache.has(digest):
            cache.touch(digest)
            return False, 0
        got = download(url, cache.part(digest), digest)
        scratch = cache.scratch(digest)
        try:
            cache.add(digest, _unpack(got.path, scratch, digest))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        got.path.unlink()
        return True, got.requests


def _link(dest: Path, target: Path) -> None:
    if dest.exists() and not dest.is_symlink():
        raise ConfigError(f"{dest} exists and is not a link into the cache: give a new folder")
    tmp = dest.parent / f".{dest.name}.link"
    if tmp.is_symlink():
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, dest)


def fetch_model(url: str, dest: str | os.PathLike[str], sha256: str, cache_dir: str | None = None,
                max_bytes: int | None = None) -> Fetched:
    started = time.monotonic()
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    evicted: list[str] = []
    if cache_dir is None:
        downloaded, requests = _fetch_into(url, dest, sha256)
        path = dest
    else:
        cache = ModelCache(cache_dir).ensure()
        downloaded, requests = _fetch_cached(url, cache, sha256)
        path = cache.entry(sha256)
        _link(dest, path)
        if max_bytes is not None:
            evicted = cache.evict(max_bytes, keep=sha256).removed
    return Fetched(sha256, str(path), folder_bytes(path), downloaded, requests,
                   round(time.monotonic() - started, 3), evicted)
