"""Offloader: the runner's offload policy, wired to the pipeline through forward pre-hooks.

Built once per runner from ``StageConfig.offload`` (``mode: none`` builds nothing: the runner is then
exactly what it was without offload). Every module of every managed unit gets one forward pre-hook
that calls :meth:`Offloader.enter` — so request mode (one diffusers ``__call__``) and step mode
(``prepare_encode`` / ``denoise_step`` / ``post_decode``) are covered alike, and no module of a unit
can run before the unit is resident.

Policy on entering a unit:

- phases exclude each other: entering a unit of another component (encode → denoise → decode)
  first releases every unit of the previous components ("brought in before its phase, released after");
- ``layerwise`` and ``distributed`` (denoiser blocks, a ring in execution order): the block is made resident (waiting
  for its prefetch when one is in flight), blocks whose next use is farthest are released so that at
  most ``resident_layers`` blocks are materialised, and the next block is prefetched.

The runner calls :meth:`release_all` on every terminal path of a call (done, aborted, failed; in step
mode when no request state is left) and :meth:`close` when it closes.
"""

from __future__ import annotations

import torch

from stage_runtime.config import OffloadConfig
from stage_runtime.errors import ConfigError
from stage_runtime.offload.manager import Residency, ResidencyManager
from stage_runtime.offload.plan import Unit, resolve_units
from stage_runtime.offload.tiers import DiskTier, HostTier


def make_tier(config: OffloadConfig, device: torch.device, groups=None):
    """``mode: distributed`` with all-gather: the peers' shards (``groups``: the rank's ParallelGroups); else
    ``cuda ↔ cpu`` on CUDA devices, ``cpu ↔ disk`` everywhere else."""
    if config.dlo:
        from stage_runtime.offload.gather import GatherTier

        return GatherTier(device, groups.dp_group, groups.dp_rank, groups.dp_size)
    return HostTier(device) if device.type == "cuda" else DiskTier(config.dir)


class Offloader:
    def __init__(self, config: OffloadConfig, pipe, denoiser: torch.nn.Module | tuple[torch.nn.Module, ...],
                 device: torch.device, tier=None, block_lists: tuple[str, ...] | None = None,
                 components: tuple[str, ...] | None = None, groups=None):
        self.config = config
        layered = config.mode in ("layerwise", "distributed")
        self.units = resolve_units(pipe, denoiser, "layerwise" if layered else config.mode,
                                   config.components or components or (), block_lists)
        self.tier = tier if tier is not None else make_tier(config, device, groups)
        bounds_resident = isinstance(self.tier, DiskTier)       # host memory = what is materialised
        self._check_bound(bounds_resident)
        self.manager = ResidencyManager(self.units, self.tier,
                                        config.max_host_bytes if bounds_resident else None,
                                        prefetch=layered and config.prefetch)
        self.blocks: dict[str, list[Unit]] = {}
        self.heads: dict[str, Unit] = {}
        for unit in self.units:
            if unit.kind == "block":
                self.blocks.setdefault(unit.component, []).append(unit)
            elif unit.kind == "head":
                self.heads[unit.component] = unit
        self._current: Unit | None = None
        self._component: str | None = None
        self._handles = []
        try:
            self.manager.start()
        except BaseException:
            self.tier.close()              # drop the mappings made before the failure; the weights stay in place
            raise
        for unit in self.units:
            for module in unit.modules:
                self._handles.append(module.register_forward_pre_hook(self._hook(unit)))

    def _hook(self, unit: Unit):
        def pre_hook(module, args):
            self.enter(unit)
        return pre_hook

    def _check_bound(self, bounds_resident: bool) -> None:
        """ConfigError when ``max_host_bytes`` cannot hold the smallest working set of any phase."""
        limit = self.config.max_host_bytes
        if limit is None:
            return
        if not bounds_resident:
            need, what = sum(u.nbytes for u in self.units), "the host copies of every managed weight"
        else:
            need, what = 0, ""
            for unit in self.units:
                if unit.kind == "block":
                    head = next(u for u in self.units if u.kind == "head" and u.component == unit.component)
                    size, label = head.nbytes + unit.nbytes, f"{head.name} + {unit.name}"
                elif unit.kind == "component":
                    size, label = unit.nbytes, unit.name
                else:
                    continue
                if size > need:
                    need, what = size, label
        if limit < need:
            hint = " or use mode=layerwise" if self.config.mode == "model" else ""
            raise ConfigError(f"offload.max_host_bytes={limit} is below the {need} bytes that must be resident "
                              f"at once ({what}); raise it{hint}")

    # -- policy ---------------------------------------------------------------------------------------------
    def enter(self, unit: Unit) -> None:
        """Called before any module of ``unit`` runs: returns only once ``unit`` is RESIDENT."""
        manager = self.manager
        if unit is self._current and manager.state[unit.name] is Residency.RESIDENT:
            return
        if unit.component != self._component:
            for other in self.units:
                if other.component != unit.component:
                    manager.release(other.name)
            self._component = unit.component
        if unit.kind == "block":
            self._enter_block(unit)
        else:
            manager.pinned = {unit.name}
            manager.ensure(unit.name)
        self._current = unit

    def _enter_block(self, unit: Unit) -> None:
        manager, blocks = self.manager, self.blocks[unit.component]
        head = self.heads[unit.component]
        manager.pinned = {head.name, unit.name}
        manager.ensure(head.name)
        n = len(blocks)
        nxt = blocks[(unit.index + 1) % n] if manager.prefetching and n > 1 else None
        want = [unit] + ([nxt] if nxt is not None else [])
        live = [b for b in blocks if manager.state[b.name] is not Residency.RELEASED]
        # Release the blocks needed last (the ones just used) until the window fits resident_layers.
        victims = sorted((b for b in live if b not in want), key=lambda b: (b.index - unit.index) % n, reverse=True)
        budget = self.config.resident_layers
        count = len(live) + sum(1 for b in want if b not in live)
        for victim in victims:
            if count <= budget:
                break
            manager.release(victim.name)
            count -= 1
        manager.ensure(unit.name)
        if nxt is not None:
            manager.prefetch(nxt.name)

    # -- terminal paths and accounting ------------------------------------------------------------------------
    def release_all(self) -> None:
        """Release every unit (waiting for any transfer in flight): the offloader then holds nothing."""
        self.manager.release_all()
        self.manager.pinned = set()
        self._current = self._component = None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.manager.close()
        self._current = self._component = None

    def stats(self) -> dict:
        return {"mode": self.config.mode, **self.manager.stats()}
