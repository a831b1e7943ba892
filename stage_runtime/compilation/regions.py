"""What is compiled: the regions of a family's denoiser, and the forward each compiled module gets.

    regional   each repeated block class of every block holder (the denoiser, or each part of a routed one: Wan 2.2's
               two experts): the model's ``_repeated_blocks`` (diffusers' own declaration), else the family's
               ``compile_blocks``. ONE compiled function per class, shared by every block of it, so the compile time
               does not grow with depth.
    full       the whole ``forward`` of each block holder.

A compiled module gets a :class:`CompiledForward` as its instance ``forward``: the module's own hooks (the step
tracker, Ulysses' shard hooks, the block cache's per-block override, CFG parallel's row split) stay outside the graph
and call into it, so none of them is traced and none of them can trigger a recompile. The hooks of the modules
*inside* a region (LoRA's per-row hook with no rows set) are traced as no-ops; a call that needs them to act runs
eagerly (``Compiler.eager``).

diffusers' ``compile_repeated_blocks`` (``module.compile()`` on each block) compiles ``Module._call_impl`` with the
block's hooks and its instance ``forward`` inside the graph: the block cache's override would be traced, and each new
override a recompile. That is why the class's ``forward`` is compiled here instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from stage_runtime.errors import ConfigError


@dataclass(eq=False)
class Region:
    """One compiled function and the modules that run it."""

    name: str                              # the block class (regional) or the component (full)
    function: Any                          # the class's forward, a plain function of (module, *args, **kwargs)
    compiled: Any = None                   # torch.compile(function), set by the compiler
    modules: list[torch.nn.Module] = field(default_factory=list)

    def describe(self) -> dict:
        return {"name": self.name, "modules": len(self.modules)}


class CompiledForward:
    """A compiled module's ``forward``: through the compiler (compiled, or eager when it says so)."""

    __slots__ = ("module", "region", "compiler", "__weakref__")

    def __init__(self, module: torch.nn.Module, region: Region, compiler):
        self.module, self.region, self.compiler = module, region, compiler

    def __call__(self, *args, **kwargs):
        return self.compiler.call(self.region, self.module, args, kwargs)

    def eager(self, *args, **kwargs):
        return self.region.function(self.module, *args, **kwargs)


def repeated_block_classes(adapter, holder: torch.nn.Module) -> tuple[str, ...]:
    """The block class names regional compilation compiles in ``holder``: the ``_repeated_blocks`` its models declare
    (the holder's own, or the model inside a family's wrapper: LTX-2's row router), else the family's
    ``compile_blocks``."""
    declared = dict.fromkeys(name for module in holder.modules() for name in getattr(module, "_repeated_blocks", None)
                             or ())
    return tuple(declared) or tuple(getattr(adapter, "compile_blocks", ()))


def find_regions(adapter, mode: str) -> list[Region]:
    """The regions of ``adapter``'s denoiser for ``mode`` ("regional" or "full"); ConfigError naming the family when
    it has nothing to compile."""
    family = type(adapter.pipe).__name__
    holders = adapter.block_holders()
    if mode == "full":
        return [Region(name, type(module).forward, modules=[module]) for name, module in holders.items()]
    by_class: dict[type, Region] = {}
    for holder_name, holder in holders.items():
        names = repeated_block_classes(adapter, holder)
        if not names:
            raise ConfigError(f"compile.mode=regional: {family}'s {holder_name} ({type(holder).__name__}) declares no "
                              "repeated blocks (_repeated_blocks) and its family names no compile_blocks; use "
                              "compile.mode=full")
        chosen: list[torch.nn.Module] = []
        for module in holder.modules():
            if type(module).__name__ in names and not any(_inside(module, outer) for outer in chosen):
                chosen.append(module)
        if not chosen:
            raise ConfigError(f"compile.mode=regional: {family}'s {holder_name} has no module of the classes "
                              f"{', '.join(names)}")
        for module in chosen:
            cls = type(module)
            by_class.setdefault(cls, Region(cls.__name__, cls.forward)).modules.append(module)
    return list(by_class.values())


def _inside(module: torch.nn.Module, outer: torch.nn.Module) -> bool:
    return any(m is module for m in outer.modules())


def install(regions: list[Region], compiler) -> None:
    """Give every module of every region its CompiledForward (an instance ``forward``, never the class's)."""
    for region in regions:
        for module in region.modules:
            if "forward" in module.__dict__:
                raise ConfigError(f"compile: {type(module).__name__}'s forward is already replaced on the instance "
                                  "(compile is installed right after loading, before any other wrapper)")
            module.forward = CompiledForward(module, region, compiler)


def uninstall(regions: list[Region]) -> None:
    """Every compiled module back to its class's forward (only where our CompiledForward is still the instance's)."""
    for region in regions:
        for module in region.modules:
            if isinstance(module.__dict__.get("forward"), CompiledForward):
                del module.__dict__["forward"]
