"""GatherTier (``mode: distributed``): every data-parallel rank keeps 1/dp of each unit; ``load`` all-gathers it.

At ``prepare`` each unit's storage groups are laid out in one flat byte buffer (each group at an offset aligned to
``ALIGN`` bytes, the total padded to a multiple of ``ALIGN × dp``); rank ``r`` keeps slice ``r`` of it on its device
(the shard) and nothing else once the manager releases the unit. A load is one ``all_gather_single`` of the shards
into a fresh buffer; the unit's tensors are then rebound as views INTO that buffer at their recorded offset, size
and stride (no second copy; Parameter identity, dtype and bytes are kept, so a gathered block computes exactly what
the whole model would). A release rebinds them to empty storages, which drops the buffer.

:meth:`begin` / :meth:`finish` split a load around an asynchronous gather: the residency manager begins the next
block's gather before the current block runs and finishes it when that block is entered (the prefetch), every call
on the rank's own thread, so every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from stage_runtime.distributed.comm import count_bytes, guarded
from stage_runtime.offload.plan import Unit
from stage_runtime.offload.tiers import free, rebinding, saved_bytes

ALIGN = 64           # bytes: any dtype's element size divides it, so every view's offset stays whole


@dataclass(eq=False)
class Layout:
    offsets: list[int]         # byte offset of each storage group in the gathered buffer
    padded: int                # the buffer's bytes: a multiple of ALIGN × world
    shard: torch.Tensor        # this rank's slice, on the device


@dataclass(eq=False)
class PendingGather:
    unit: Unit
    buffer: torch.Tensor
    work: object               # the collective's handle (None: already complete)
    started: float

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()


def _all_gather():
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class GatherTier:
    """``fast`` = the device; ``slow`` = the peers' shards."""

    def __init__(self, device: torch.device, group, rank: int, world: int):
        self.device, self.group, self.rank, self.world = device, group, rank, world
        self.fast = device.type
        self.slow = "peers"
        self.layouts: dict[str, Layout] = {}
        self.gathers = 0
        self.gather_seconds = 0.0      # from begin to the end of finish (the prefetch hides part of it)
        self.wait_seconds = 0.0        # finish blocked on the collective: what the prefetch did not hide

    def prepare(self, units: list[Unit]) -> None:
        for unit in units:
            offsets, at = [], 0
            for group in unit.groups:
                offsets.append(at)
                at += -(-group.nbytes // ALIGN) * ALIGN
            chunk = -(-max(at, 1) // (ALIGN * self.world)) * ALIGN
            flat = torch.zeros(chunk * self.world, dtype=torch.uint8, device=self.device)
            for group, offset in zip(unit.groups, offsets, strict=True):
                flat[offset:offset + group.nbytes].copy_(saved_bytes(group))
            shard = flat[self.rank * chunk:(self.rank + 1) * chunk].clone()
            del flat
            self.layouts[unit.name] = Layout(offsets, chunk * self.world, shard)
            self._move(unit)

    def _move(self, unit: Unit) -> None:
        """A unit loaded on the host (offload.load_device) moves to the device: its tensors, the same objects, become
        empty there (the release that follows keeps them so) and the host bytes are dropped."""
        for group in unit.groups:
            if group.device == self.device:
                continue
            with rebinding():
                for v in group.views:
                    v.tensor.data = torch.empty(0, dtype=v.tensor.dtype, device=self.device)
            group.device = self.device

    def begin(self, unit: Unit) -> PendingGather:
        layout = self.layouts[unit.name]
        buffer = torch.empty(layout.padded, dtype=torch.uint8, device=self.device)
        count_bytes("all_gather", layout.shard, self.world - 1)
        work = guarded(f"all_gather({unit.name})", self.group,
                       lambda: _all_gather()(buffer, layout.shard, group=self.group, async_op=True))
        return PendingGather(unit, buffer, work, time.perf_counter())

    def finish(self, pending: PendingGather) -> None:
        """Wait for the gather, then rebind the unit's tensors into the gathered buffer."""
        start = time.perf_counter()
        if pending.work is not None:
            guarded(f"all_gather({pending.unit.name}) wait", self.group, pending.work.wait)
        end = time.perf_counter()
        self.wait_seconds += end - start
        self.gather_seconds += end - pending.started
        self.gathers += 1
        storage = pending.buffer.untyped_storage()
        with rebinding():
            for group, offset in zip(pending.unit.groups, self.layouts[pending.unit.name].offsets, strict=True):
                for v in group.views:
                    v.tensor.set_(storage, offset // v.tensor.element_size() + v.offset, v.size, v.stride)

    def load(self, unit: Unit) -> None:
        self.finish(self.begin(unit))

    def release(self, unit: Unit) -> None:
        free(unit)

    def held_bytes(self) -> int:
        return sum(layout.shard.numel() for layout in self.layouts.values())

    def stats(self) -> dict:
        return {"world": self.world, "shard_bytes": self.held_bytes(), "gathers": self.gathers,
                "gather_seconds": round(self.gather_seconds, 6), "gather_wait_seconds": round(self.wait_seconds, 6)}

    def close(self) -> None:
        self.layouts.clear()
