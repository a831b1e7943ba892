"""Fault-injecting offload tiers: the real disk tier with a slow or failing medium (like adapters_for_tests)."""

from __future__ import annotations

import threading
import time

from stage_runtime.offload.tiers import DiskTier, bind, rebinding


class SlowDiskTier(DiskTier):
    """The real disk tier with a slow medium: each load sleeps first (exposes use-before-ready races)."""

    def __init__(self, delay_s: float):
        super().__init__()
        self.delay_s = delay_s
        self.loading = threading.Event()

    def load(self, unit):
        self.loading.set()
        time.sleep(self.delay_s)
        super().load(unit)


class BrokenDiskTier(DiskTier):
    """The real disk tier whose medium fails after the first storage of ``unit_name`` was copied."""

    def __init__(self, unit_name: str):
        super().__init__()
        self.unit_name = unit_name

    def load(self, unit):
        if unit.name != self.unit_name:
            return super().load(unit)
        with rebinding():                                                    # a partial load, then the failure
            bind(unit.groups[0], self.handles[unit.name].get_tensor("bytes")[:unit.groups[0].nbytes])
        raise OSError("I/O error reading the offload file")
