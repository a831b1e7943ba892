"""Large arrays across processes through POSIX shared memory, unlinked as soon as they are read.

    writer (worker rank)                          reader (executor result pump)
    ------------------------------------          ----------------------------------------------
    fd = open(/dev/shm/<prefix><n>, O_EXCL)       fd = open(/dev/shm/<name>); mm = mmap(fd)
    ftruncate(nbytes); mmap; copy array in        unlink(/dev/shm/<name>)   <- the name is gone now
    send ShmArray(name, shape, dtype) inline      array = frombuffer(mm)    (zero copy; the pages
                                                                             live until array is freed)

Arrays up to ``SHM_THRESHOLD`` bytes travel inline in the pickled message. Every segment name starts
with the executor's prefix (``ds-<token>-``), so whatever a crash leaves behind (a worker killed between
creating and sending, an executor killed before reading) is removed by :func:`sweep` at shutdown — and
by each worker for its own segments when its parent dies. Linux only (``/dev/shm``); elsewhere every
array stays inline.
"""

from __future__ import annotations

import dataclasses
import itertools
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stage_runtime.outputs import BatchRunnerOutput, RunnerOutput

SHM_DIR = Path("/dev/shm")
SHM_THRESHOLD = 1 << 20          # bytes; larger arrays go through shared memory


@dataclass(frozen=True)
class ShmArray:
    """A handle that replaces an ndarray in a message: the reader maps it, then unlinks it."""

    name: str
    shape: tuple[int, ...]
    dtype: str


class ShmWriter:
    """One rank's segment factory: names ``<prefix>r<rank>-<n>``, unique for the executor's life."""

    def __init__(self, prefix: str, rank: int, threshold: int = SHM_THRESHOLD):
        self.prefix = f"{prefix}r{rank}-"
        self.threshold = threshold if SHM_DIR.is_dir() else float("inf")
        self._names = itertools.count()

    def put(self, array: np.ndarray) -> np.ndarray | ShmArray:
        if array.nbytes <= self.threshold or array.dtype.hasobject:
            return array
        name = f"{self.prefix}{next(self._names)}"
        fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, array.nbytes)
            with mmap.mmap(fd, array.nbytes) as mm:
                np.frombuffer(mm, dtype=array.dtype, count=array.size).reshape(array.shape)[...] = array
        except BaseException:
            os.unlink(SHM_DIR / name)
            raise
        finally:
            os.close(fd)
        return ShmArray(name, tuple(array.shape), array.dtype.str)

    def pack(self, obj: Any) -> Any:
        """A copy of ``obj`` with every large ndarray replaced by a handle (inputs are not mutated)."""
        if isinstance(obj, np.ndarray):
            return self.put(obj)
        if isinstance(obj, RunnerOutput):
            return obj if obj.images is None else dataclasses.replace(obj, images=self.put(obj.images))
        if isinstance(obj, BatchRunnerOutput):
            return BatchRunnerOutput({rid: self.pack(o) for rid, o in obj.outputs.items()})
        if isinstance(obj, dict):
            return {k: self.pack(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.pack(v) for v in obj)
        return obj


def read(handle: ShmArray) -> np.ndarray:
    """Map the segment, unlink it at once, and return a zero-copy array over the mapping."""
    path = SHM_DIR / handle.name
    fd = os.open(path, os.O_RDONLY)
    try:
        os.unlink(path)
        dtype = np.dtype(handle.dtype)
        count = int(np.prod(handle.shape, dtype=np.int64))
        if count == 0:
            return np.empty(handle.shape, dtype)
        mm = mmap.mmap(fd, count * dtype.itemsize, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return np.frombuffer(mm, dtype=dtype, count=count).reshape(handle.shape)


def unpack(obj: Any) -> Any:
    """Inverse of :meth:`ShmWriter.pack`: every handle read (and unlinked)."""
    if isinstance(obj, ShmArray):
        return read(obj)
    if isinstance(obj, RunnerOutput):
        return obj if not isinstance(obj.images, ShmArray) else dataclasses.replace(obj, images=read(obj.images))
    if isinstance(obj, BatchRunnerOutput):
        return BatchRunnerOutput({rid: unpack(o) for rid, o in obj.outputs.items()})
    if isinstance(obj, dict):
        return {k: unpack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(unpack(v) for v in obj)
    return obj


def sweep(prefix: str) -> list[str]:
    """Unlink every segment whose name starts with ``prefix``; returns what was removed."""
    removed = []
    if SHM_DIR.is_dir():
        for path in SHM_DIR.glob(f"{prefix}*"):
            try:
                path.unlink()
                removed.append(path.name)
            except FileNotFoundError:
                continue                  # its reader unlinked it first
    return removed
