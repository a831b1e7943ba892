"""ResidencyManager: the one owner of every managed unit's residency and of every transition.

States per unit (one at a time, changed only here, under one lock):

    RELEASED --load/prefetch--> LOADING --transfer done--> RESIDENT --release--> RELEASED

``ensure(unit)`` returns only once the unit is RESIDENT (it loads synchronously, or waits for the
prefetch in flight): that is the "used only when ready" rule, and the forward hooks call it before any
module of the unit runs. A release never races a load (it waits for it first). Memory is bounded:
before a load the manager evicts least-recently-used resident units outside the pinned set until the
unit fits under ``max_resident_bytes``; a prefetch that does not fit is skipped, never forced. Resident
bytes are measured from the storages' actual sizes, not assumed from the plan.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from stage_runtime.errors import WorkerFatalError
from stage_runtime.offload.plan import Unit


class Residency(enum.Enum):
    RELEASED = "released"
    LOADING = "loading"
    RESIDENT = "resident"


class Deferred:
    """A prefetch started on the manager's own thread (an asynchronous collective) and completed by the first
    :meth:`result`: the Future shape :meth:`ResidencyManager._wait` expects, with no second thread."""

    def __init__(self, manager: ResidencyManager, name: str, pending):
        self.manager, self.name, self.pending = manager, name, pending
        self.finished = False

    def done(self) -> bool:
        return self.pending.is_completed()

    def result(self) -> None:
        if not self.finished:
            self.finished = True
            self.manager._transfer(self.name, self.pending)


class ResidencyManager:
    def __init__(self, units: list[Unit], tier, max_resident_bytes: int | None = None, prefetch: bool = False):
        self.units = {u.name: u for u in units}
        self.tier = tier
        self.max_resident_bytes = max_resident_bytes
        self.state: dict[str, Residency] = {u.name: Residency.RESIDENT for u in units}
        self._lru: OrderedDict[str, None] = OrderedDict((u.name, None) for u in units)  # resident, oldest first
        self._inflight: dict[str, Future] = {}
        self._lock = threading.RLock()
        # A tier with begin/finish (GatherTier: a collective) starts a prefetch on this thread and finishes it when
        # the unit is needed; the others load on one background thread.
        self._deferred = hasattr(tier, "begin")
        self._prefetch = prefetch
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix="offload-prefetch")
                      if prefetch and not self._deferred else None)
        self.pinned: set[str] = set()          # units in use right now: never evicted
        self.closed = False
        self.counters = {"loads": 0, "releases": 0, "evictions": 0, "bytes_loaded": 0, "load_seconds": 0.0,
                         "prefetches": 0, "prefetch_hits": 0, "prefetch_waits": 0, "prefetch_skipped": 0}
        self._resident = sum(u.nbytes for u in units)
        self.peak_resident_bytes = 0

    @property
    def prefetching(self) -> bool:
        return self._prefetch

    # -- setup / teardown -----------------------------------------------------------------------------------
    def start(self) -> None:
        """Save every unit to the tier once, then release them all: the initial residency is RELEASED."""
        self.tier.prepare(list(self.units.values()))
        self.release_all()
        self.peak_resident_bytes = self._resident

    def close(self) -> None:
        """Release every unit and the tier's files/copies. Idempotent; the units are unusable afterwards."""
        if self.closed:
            return
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.release_all()
        self.tier.close()
        self.closed = True

    # -- transitions ------------------------------------------------------------------------------------------
    def ensure(self, name: str) -> None:
        """Return once ``name`` is RESIDENT (loading it, or waiting for its prefetch)."""
        future = self._inflight.get(name)
        if future is None and self.state[name] is Residency.RESIDENT:
            self._touch(name)
            return
        if future is not None:
            self.counters["prefetch_hits" if future.done() else "prefetch_waits"] += 1
            self._wait(name, future)
        with self._lock:
            if self.state[name] is Residency.RELEASED:
                self._load(name, evict=True)
            self._touch(name)
        if self.state[name] is not Residency.RESIDENT:      # the invariant, checked, not assumed
            raise WorkerFatalError(f"offload: unit {name} used while {self.state[name].value}")

    def prefetch(self, name: str) -> None:
        """Start loading ``name`` in the background when it is released and fits; otherwise do nothing."""
        if not self._prefetch or self.closed:
            return
        with self._lock:
            if self.state[name] is not Residency.RELEASED:
                return
            if not self._fits(self.units[name].nbytes):
                self.counters["prefetch_skipped"] += 1
                return
            self.state[name] = Residency.LOADING
            self._resident += self.units[name].nbytes      # reserved now: the bound holds during the copy
            self.counters["prefetches"] += 1
            self._inflight[name] = (Deferred(self, name, self.tier.begin(self.units[name])) if self._deferred
                                    else self._pool.submit(self._transfer, name))

    def release(self, name: str) -> None:
        with self._lock:
            future = self._inflight.get(name)
        if future is not None:
            self._wait(name, future)
        with self._lock:
            if self.state[name] is Residency.RESIDENT:
                self._release(name)

    def release_all(self) -> None:
        for name in list(self.units):
            self.release(name)

    # -- internals (callers hold the lock, except _transfer which runs on the prefetch thread) ---------------
    def _load(self, name: str, evict: bool) -> None:
        unit = self.units[name]
        if evict:
            self._make_room(unit.nbytes)
        self.state[name] = Residency.LOADING
        self._resident += unit.nbytes
        try:
            self._transfer(name)
        except Exception as exc:
            raise WorkerFatalError(f"offload: loading {name} failed: {type(exc).__name__}: {exc}") from exc

    def _transfer(self, name: str, pending=None) -> None:
        unit = self.units[name]
        start = time.perf_counter()
        try:
            if pending is not None:
                self.tier.finish(pending)
            else:
                self.tier.load(unit)
        except BaseException:
            with self._lock:
                self.tier.release(unit)
                self._resident -= unit.nbytes
                self.state[name] = Residency.RELEASED
            raise
        with self._lock:
            self.counters["loads"] += 1
            self.counters["bytes_loaded"] += unit.nbytes
            self.counters["load_seconds"] += time.perf_counter() - start
            self.state[name] = Residency.RESIDENT
            self._lru[name] = None
            self.peak_resident_bytes = max(self.peak_resident_bytes, self._resident)

    def _wait(self, name: str, future: Future) -> None:
        try:
            future.result()
        except Exception as exc:
            raise WorkerFatalError(f"offload: loading {name} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            with self._lock:
                if self._inflight.get(name) is future:
                    del self._inflight[name]

    def _release(self, name: str) -> None:
        unit = self.units[name]
        self.tier.release(unit)
        self.state[name] = Residency.RELEASED
        self._lru.pop(name, None)
        self._resident -= unit.nbytes
        self.counters["releases"] += 1

    def _fits(self, nbytes: int) -> bool:
        return self.max_resident_bytes is None or self._resident + nbytes <= self.max_resident_bytes

    def _make_room(self, nbytes: int) -> None:
        for victim in list(self._lru):
            if self._fits(nbytes):
                return
            if victim not in self.pinned and self.state[victim] is Residency.RESIDENT:
                self._release(victim)
                self.counters["evictions"] += 1
        if not self._fits(nbytes):
            raise WorkerFatalError(f"offload: cannot bring in {nbytes} bytes under a bound of "
                                   f"{self.max_resident_bytes} ({self._resident} bytes resident and pinned)")

    def _touch(self, name: str) -> None:
        if name in self._lru:
            self._lru.move_to_end(name)

    # -- accounting -------------------------------------------------------------------------------------------
    def measured_resident_bytes(self) -> int:
        """Bytes the managed storages hold right now, summed from their actual sizes."""
        return sum(u.materialised_bytes() for u in self.units.values())

    def stats(self) -> dict:
        with self._lock:
            resident = self.measured_resident_bytes()
            total = sum(u.nbytes for u in self.units.values())
            states = list(self.state.values())
            return {
                "tier": f"{self.tier.fast}<->{self.tier.slow}",
                "units": len(self.units),
                "units_resident": states.count(Residency.RESIDENT),
                "units_loading": states.count(Residency.LOADING),
                "managed_bytes": total,
                "resident_bytes": {self.tier.fast: resident, self.tier.slow: total - resident},
                "host_held_bytes": self.tier.held_bytes(),
                "peak_resident_bytes": self.peak_resident_bytes,
                "max_resident_bytes": self.max_resident_bytes,
                **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.counters.items()},
                **(self.tier.stats() if hasattr(self.tier, "stats") else {}),
            }
