"""The node-local model cache: pipelines stored by the SHA-256 of their archive, LRU eviction under a byte
budget, and a lock each user holds so a model in use is never removed.

    CACHE/.diffstage-model-cache   marker (the folder is a cache: `hold()` looks for it)
    CACHE/models/<sha256>/          a complete pipeline (appears only by an atomic rename)
    CACHE/models/<sha256>.used      its last use (mtime: the LRU clock); every user holds a shared flock on it
    CACHE/tmp/                      downloads in progress (<sha256>.part, resumable) and unpacking
    CACHE/locks/<sha256>.fetch      exclusive while one process fetches that digest (the others wait, then reuse)
    CACHE/locks/evict               exclusive while evicting

Locks are `flock`s: the kernel drops them when their process dies, so a crashed stage never pins a model
for ever, and pods on one node share them through a hostPath (or a ReadWriteMany claim on one node).
Eviction (after each fetch) removes the least recently used entries until the total fits `max_bytes`,
skipping the one just fetched, every entry whose `.used` lock another process holds, and entries used
within `grace_s` (the moments between an init container's fetch and its stage taking the lock). If what
is left still exceeds the budget, that is reported, never "fixed" by removing a model in use.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from stage_runtime.fetch.archive import folder_bytes

log = logging.getLogger(__name__)
MARKER = ".diffstage-model-cache"
EVICT_GRACE_S = 600.0


@dataclass(frozen=True)
class Eviction:
    removed: list[str]          # digests removed, least recently used first
    kept_in_use: list[str]      # over budget but held by a stage (or inside the grace period)
    total_bytes: int            # what the cache holds afterwards


class ModelCache:
    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)
        self.models, self.tmp, self.locks = self.root / "models", self.root / "tmp", self.root / "locks"

    def ensure(self) -> ModelCache:
        for folder in (self.models, self.tmp, self.locks):
            folder.mkdir(parents=True, exist_ok=True)
        (self.root / MARKER).touch()
        return self

    def entry(self, digest: str) -> Path:
        return self.models / digest

    def used_file(self, digest: str) -> Path:
        return self.models / f"{digest}.used"

    def part(self, digest: str) -> Path:
        return self.tmp / f"{digest}.part"

    def has(self, digest: str) -> bool:
        return self.entry(digest).is_dir()

    @contextmanager
    def fetching(self, digest: str) -> Iterator[None]:
        """Exclusive per digest: a second fetch of the same model waits here, then finds it cached."""
        with _flocked(self.locks / f"{digest}.fetch", fcntl.LOCK_EX):
            yield

    def add(self, digest: str, unpacked: Path) -> Path:
        """Move a complete pipeline folder (under `tmp/`) into place atomically."""
        target = self.entry(digest)
        os.rename(unpacked, target)
        self.touch(digest)
        return target

    def scratch(self, name: str) -> Path:
        return self.tmp / f"{name}-{uuid.uuid4().hex[:8]}"

    def touch(self, digest: str, at: float | None = None) -> None:
        path = self.used_file(digest)
        path.touch()
        if at is not None:
            os.utime(path, (at, at))

    def entries(self) -> list[tuple[float, str, int]]:
        """(last use, digest, bytes) of every complete entry, least recently used first."""
        out = []
        for folder in self.models.iterdir() if self.models.is_dir() else ():
            if folder.is_dir():
                used = self.used_file(folder.name)
                last = used.stat().st_mtime if used.exists() else folder.stat().st_mtime
                out.append((last, folder.name, folder_bytes(folder)))
        return sorted(out)

    def evict(self, max_bytes: int, keep: str | None = None, grace_s: float = EVICT_GRACE_S,
              now: float | None = None) -> Eviction:
        now = time.time() if now is None else now
        with _flocked(self.locks / "evict", fcntl.LOCK_EX):
            entries = self.entries()
            total = sum(size for _, _, size in entries)
            removed, kept = [], []
            for last, digest, size in entries:
                if total <= max_bytes:
                    break
                if digest == keep or now - last < grace_s or not self._remove_if_unused(digest):
                    kept.append(digest)
                    continue
                removed.append(digest)
                total -= size
            if total > max_bytes:
                log.warning("model cache %s holds %d bytes, over its %d-byte budget: %s in use", self.root, total,
                            max_bytes, ", ".join(kept) or "nothing else")
            for digest in removed:
                log.info("evicted model %s from %s (least recently used)", digest, self.root)
            return Eviction(removed, kept, total)

    def _remove_if_unused(self, digest: str) -> bool:
        used = self.used_file(digest)
        fd = os.open(used, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False                    # a stage holds it: in use
            doomed = self.scratch(f"evict-{digest}")
            os.rename(self.entry(digest), doomed)   # gone from models/ at once; the bytes go next
            shutil.rmtree(doomed)
            os.unlink(used)
            return True
        finally:
            os.close(fd)


@contextmanager
def _flocked(path: Path, mode: int) -> Iterator[int]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, mode)
        yield fd
    finally:
        os.close(fd)


def cache_of(model_dir: str | os.PathLike[str]) -> tuple[ModelCache, str] | None:
    """The cache and digest a model folder belongs to (following the link fetch-model made), or None."""
    real = Path(os.path.realpath(model_dir))
    if real.parent.name != "models" or not (real.parent.parent / MARKER).exists():
        return None
    return ModelCache(real.parent.parent), real.name


def hold(model_dir: str | os.PathLike[str]) -> int | None:
    """Mark a cached model as in use for as long as this process lives (or until `release`): a shared flock
    on its `.used` file, which is touched (its last use). Returns the descriptor; None when not cached."""
    found = cache_of(model_dir)
    if found is None:
        return None
    cache, digest = found
    fd = os.open(cache.used_file(digest), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)
    os.utime(fd)
    return fd


def release(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)
