"""One rank's weights given back while the stage sleeps (``POST /sleep``; docs/sleep-and-profile.md).

The modules stay — their hooks, compiled forwards, LoRA factors (held apart from the weights), attention
processors — only the tensors' storages move or go, and come back into the same ``Parameter`` objects:

- level 1: each module component's tensors copied to pinned host memory, the device's allocator cache emptied; wake
  copies them back. On a CPU device the weights already live in host memory: nothing moves.
- level 2: every parameter and buffer of every module component replaced by an empty tensor (host memory given back
  to the OS: ``malloc_trim``), and on wake read again from the model source the stage loaded (``reload``: the
  family's own load, on the CPU), copied in by name. What the served weights are not — quantized storages, a
  tensor-parallel shard, offloaded tiers — cannot be read again from the folder: level 2 is refused there.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import time
from collections.abc import Callable

import torch

from stage_runtime.errors import InvalidRequestError

log = logging.getLogger(__name__)


def give_back_host_memory() -> None:
    """Freed tensors' pages back to the OS (glibc keeps small freed blocks in its arenas otherwise)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):             # not glibc: the allocator keeps what it keeps
        log.debug("malloc_trim is not available; freed host memory stays with the allocator")


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A device tensor's copy in pinned host memory (the wake's copy back is then a DMA); a tensor subclass whose
    storage cannot be pinned (a quantized layout), in pageable memory."""
    host = tensor.to("cpu")
    try:
        return host.pin_memory()
    except (RuntimeError, NotImplementedError):
        return host


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


class WeightSleeper:
    """The rank's sleep state: ``sleep(level)`` and ``wake()`` over the pipeline's module components."""

    def __init__(self, device: torch.device, reload: Callable[[], dict[str, torch.nn.Module]], refusal: str | None):
        self.device = device
        self.reload = reload                  # → {component: module}, the folder's weights on the CPU
        self.refusal = refusal                # level 2 refused: why
        self.level: int | None = None

    def sleep(self, components: dict[str, torch.nn.Module], level: int) -> dict:
        if level not in (1, 2):
            raise InvalidRequestError("level", level, "sleep levels are 1 (weights to host memory) and 2 (dropped)")
        if level == 2 and self.refusal is not None:
            raise InvalidRequestError("level", level, f"level 2 drops the weights and reads the model source again, "
                                      f"but {self.refusal}; use level 1")
        if self.level is not None:
            return {"level": self.level, "already": True}
        started = time.perf_counter()
        if level == 1:
            if self.device.type != "cpu":
                for module in components.values():
                    module._apply(to_host)          # every parameter and buffer, tensor subclasses included
        else:
            for module in components.values():
                for tensor in _tensors(module).values():
                    tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        give_back_host_memory()
        self.level = level
        return {"level": level, "seconds": round(time.perf_counter() - started, 3)}

    def wake(self, components: dict[str, torch.nn.Module]) -> dict:
        if self.level is None:
            return {"level": None, "already": True}
        started = time.perf_counter()
        if self.level == 1:
            if self.device.type != "cpu":
                for module in components.values():
                    module.to(self.device, non_blocking=True)
        else:
            fresh = self.reload()
            for name, module in components.items():
                self._refill(name, module, fresh[name])
            del fresh
            give_back_host_memory()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        level, self.level = self.level, None
        return {"level": level, "seconds": round(time.perf_counter() - started, 3)}

    def _refill(self, name: str, module: torch.nn.Module, fresh: torch.nn.Module) -> None:
        """The source's tensors into the served module's, by name; a name either lacks is a RuntimeError (the
        worker fails closed: a half-filled model must not serve)."""
        mine, theirs = _tensors(module), _tensors(fresh)
        if set(mine) != set(theirs):
            missing = sorted(set(mine) ^ set(theirs))[:3]
            raise RuntimeError(f"wake: {name} read from the model source has other tensors than the one served "
                               f"(first differences: {missing})")
        with torch.no_grad():
            for key, tensor in mine.items():
                tensor.data = theirs[key].to(self.device, tensor.dtype)
