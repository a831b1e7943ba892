"""Where a released unit's bytes live, and the two transfers: ``load`` (materialise) and ``release``.

``release`` rebinds every tensor of the unit to an empty storage (the memory is really freed; a module
that ran anyway would fail on the empty shape, never read freed memory); ``load`` allocates each
storage again, copies the saved bytes in and rebinds the SAME tensor objects with their recorded
offset, size and stride: Parameter identity, dtype, device and values (bitwise) are kept.

- :class:`DiskTier` (``cpu ↔ disk``, any device): every unit is written ONCE to a safetensors file
  (the unit's storages as one raw-byte tensor) and memory-mapped back with ``safe_open`` (each load maps
  the bytes once and copies them out of the page cache). The file is unlinked as soon as it is mapped and the
  folder removed right away: no file descriptor stays open and nothing is left on disk, even if the
  process is SIGKILLed. ``close()`` drops the mappings.
- :class:`HostTier` (``cuda ↔ cpu``): one immutable host master per storage (pinned on CUDA); weights
  are read-only while serving, so a release needs no device→host copy. The masters are the retained
  host copies counted against ``max_host_bytes``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from stage_runtime.errors import ConfigError
from stage_runtime.offload.plan import StorageGroup, Unit


def byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def rebinding():
    """Rebinding parameters: plain tensors (also inside inference mode), no autograd."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.no_grad())
    return stack


def bind(group: StorageGroup, source: torch.Tensor, non_blocking: bool = False) -> None:
    """Materialise ``group``: a new storage filled from ``source`` (raw bytes), every view rebound to it."""
    storage = torch.UntypedStorage(group.nbytes, device=group.device)
    byte_view(storage).copy_(source, non_blocking=non_blocking)
    for v in group.views:
        v.tensor.set_(storage, v.offset, v.size, v.stride)


def free(unit: Unit) -> None:
    with rebinding():
        for group in unit.groups:
            for v in group.views:
                v.tensor.set_(torch.empty(0, dtype=v.tensor.dtype, device=v.tensor.device))


def saved_bytes(group: StorageGroup) -> torch.Tensor:
    """The group's current storage as raw bytes (it must be materialised)."""
    return byte_view(group.views[0].tensor.untyped_storage())


class DiskTier:
    fast = "cpu"
    slow = "disk"

    def __init__(self, parent_dir: str | None = None):
        self.parent_dir = parent_dir
        self.handles: dict[str, object] = {}    # unit name → safe_open handle (an mmap, no open fd)
        self.file_bytes = 0

    def prepare(self, units: list[Unit]) -> None:
        try:
            folder = tempfile.mkdtemp(prefix="diffstage-offload-", dir=self.parent_dir)
        except OSError as exc:
            raise ConfigError(f"offload.dir={self.parent_dir!r}: cannot create the offload folder there: "
                              f"{exc.strerror or exc}") from None
        try:
            for i, unit in enumerate(units):
                path = os.path.join(folder, f"{i:04d}.safetensors")
                save_file({"bytes": torch.cat([saved_bytes(g) for g in unit.groups])}, path)   # one blob
                self.file_bytes += os.path.getsize(path)
                self.handles[unit.name] = safe_open(path, framework="pt", device="cpu")
                os.unlink(path)
        finally:
            shutil.rmtree(folder)

    def load(self, unit: Unit) -> None:
        blob, at = self.handles[unit.name].get_tensor("bytes"), 0      # one mapping per load, dropped after
        with rebinding():
            for group in unit.groups:
                bind(group, blob[at:at + group.nbytes])
                at += group.nbytes

    def release(self, unit: Unit) -> None:
        free(unit)

    def held_bytes(self) -> int:
        return 0        # the file pages belong to the page cache, not to this process's heap

    def close(self) -> None:
        self.handles.clear()


class HostTier:
    slow = "cpu"

    def __init__(self, device: torch.device):
        self.device = device
        self.fast = device.type
        self.masters: dict[str, list[torch.Tensor]] = {}
        self.pinned = device.type == "cuda"

    def prepare(self, units: list[Unit]) -> None:
        for unit in units:
            masters = []
            for group in unit.groups:
                host = torch.empty(group.nbytes, dtype=torch.uint8, pin_memory=self.pinned)
                host.copy_(saved_bytes(group))
                masters.append(host)
            self.masters[unit.name] = masters

    def load(self, unit: Unit) -> None:
        with rebinding():
            for group, host in zip(unit.groups, self.masters[unit.name], strict=True):
                bind(group, host, non_blocking=self.pinned)
        if self.pinned:
            torch.cuda.current_stream(self.device).synchronize()   # ready = the copies completed

    def release(self, unit: Unit) -> None:
        free(unit)

    def held_bytes(self) -> int:
        return sum(h.numel() for masters in self.masters.values() for h in masters)

    def close(self) -> None:
        self.masters.clear()
