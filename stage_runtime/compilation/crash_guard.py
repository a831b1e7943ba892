"""A warm-up that killed its process (a segfault in generated code, an OOM kill) is not tried again: never a crash loop.

A rank that compiles into a cache folder holds a marker file there for its warm-up, locked (``flock``) while it
runs and removed when the warm-up ends. The next process of the same model, mode and rank that finds the marker
UNLOCKED knows its holder died mid-warm-up, and serves eagerly with that reason instead of compiling (the stage is
then ready, and says why). A marker locked by a live process is another replica warming up on the same node: it is
left alone. Deleting the marker retries the compile. Without a cache folder nothing persists across a restart, so
there is no guard (docs/compile.md).

Measured here: torch 2.13's inductor with ``cpp_wrapper`` on CPU segfaults running Z-Image's compiled
``_prepare_sequence`` (an op without a C shim, run through its proxy executor): exactly what this is for.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path


class CrashGuard:
    def __init__(self, cache_dir: str, key: str):
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        self.path = Path(cache_dir) / "diffstage-warmups" / f"{digest}.pending"
        self.key = key
        self._fd: int | None = None

    def previous_died(self) -> bool:
        """True when a marker is left that no live process holds (its warm-up died with its process)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False                      # another process is warming up now
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return True
        finally:
            os.close(fd)

    def hold(self) -> None:
        """This process's warm-up begins: the marker, locked until :meth:`release` (or this process's death)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"{self.key}\npid {os.getpid()}\n".encode())

    def release(self) -> None:
        """The warm-up ended (compiled, or fell back on its own): the marker goes."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
