"""Where a released unit's bytes live, and the two transfers: ``load`` (materialise) and ``release``.

Both tiers work on a unit's storages in place: ``release`` resizes each storage to 0 bytes (the memory
is really freed; every Parameter and buffer keeps its identity, shape, dtype and device), ``load``
resizes it back and copies the saved bytes in, so values come back bitwise.

- :class:`DiskTier` (``cpu ↔ disk``, any device): every unit is written ONCE to a safetensors file
  (one raw-byte tensor per storage) and memory-mapped back with ``safe_open``. The file is unlinked as
  soon as it is mapped and the folder removed right away: the mapping keeps the bytes, no file
  descriptor stays open, and nothing is left on disk even if the process is SIGKILLed. ``close()``
  drops the mappings.
- :class:`HostTier` (``cuda ↔ cpu``): one immutable host master per storage (pinned on CUDA); weights
  are read-only while serving, so a release needs no device→host copy. The masters are the retained
  host copies counted against ``max_host_bytes``.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from stage_runtime.errors import ConfigError
from stage_runtime.offload.plan import Unit


def byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def free_storages(unit: Unit) -> None:
    for st in unit.storages:
        st.resize_(0)


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
                save_file({f"s{j}": byte_view(st) for j, st in enumerate(unit.storages)}, path)
                self.file_bytes += os.path.getsize(path)
                self.handles[unit.name] = safe_open(path, framework="pt", device="cpu")
                os.unlink(path)
        finally:
            shutil.rmtree(folder)

    def load(self, unit: Unit) -> None:
        handle = self.handles[unit.name]
        for j, st in enumerate(unit.storages):
            saved = handle.get_tensor(f"s{j}")
            st.resize_(saved.numel())
            byte_view(st).copy_(saved)

    def release(self, unit: Unit) -> None:
        free_storages(unit)

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
            for st in unit.storages:
                host = torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=self.pinned)
                host.copy_(byte_view(st))
                masters.append(host)
            self.masters[unit.name] = masters

    def load(self, unit: Unit) -> None:
        for st, host in zip(unit.storages, self.masters[unit.name], strict=True):
            st.resize_(host.numel())
            byte_view(st).copy_(host, non_blocking=self.pinned)
        if self.pinned:
            torch.cuda.current_stream(self.device).synchronize()   # ready = the copies completed

    def release(self, unit: Unit) -> None:
        free_storages(unit)

    def held_bytes(self) -> int:
        return sum(h.numel() for masters in self.masters.values() for h in masters)

    def close(self) -> None:
        self.masters.clear()
