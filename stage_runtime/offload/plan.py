"""Offload plan: which weights form which unit (pure discovery over a loaded pipeline; moves nothing).

A *unit* is the smallest thing the residency manager moves: a whole component (``model`` mode), or —
``layerwise`` mode, for the denoiser — each block plus one ``head`` unit holding the denoiser weights
outside its blocks (embeddings, norms, projections). Units own *storages*, not tensors: every
parameter and buffer of the unit's modules is reduced to its distinct untyped storage, so views,
tied weights and any dtype move as raw bytes (bitwise) and the tensors themselves never change.
A storage may belong to one unit only. Storages that cannot be resized (e.g. created from a
loaded file's buffer) are *adopted* once: copied into a fresh storage that every tensor viewing them
is rebound to (``Tensor.set_``, same offset, size and stride: the Parameter objects stay the same).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stage_runtime.errors import ConfigError

# Denoiser attributes holding its blocks, in execution order (UNet: down, mid, up; DiT/Flux-like: blocks).
BLOCK_ATTRS = ("down_blocks", "mid_block", "up_blocks", "transformer_blocks", "single_transformer_blocks", "blocks")


@dataclass(eq=False)
class Unit:
    name: str                              # "text_encoder", "vae", "transformer.head", "unet.block3"
    component: str                         # the pipeline component it belongs to
    kind: str                              # "component" | "head" | "block"
    modules: list[torch.nn.Module]         # modules whose forward uses the unit (hooks go here)
    storages: list[torch.UntypedStorage]   # distinct storages it owns
    nbytes: int = 0                        # bytes when materialised (from the storages at plan time)
    index: int = -1                        # block position in execution order (blocks only)
    tensors: list[torch.Tensor] = field(default_factory=list)   # params and buffers (for checks and stats)


def module_components(pipe) -> dict[str, torch.nn.Module]:
    return {name: comp for name, comp in pipe.components.items() if isinstance(comp, torch.nn.Module)}


def _tensors(modules: list[torch.nn.Module]) -> list[torch.Tensor]:
    out, seen = [], set()
    for module in modules:
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


def _by_storage(tensors: list[torch.Tensor]) -> dict[int, list[torch.Tensor]]:
    groups: dict[int, list[torch.Tensor]] = {}
    for t in tensors:
        if t.untyped_storage().nbytes():
            groups.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    return groups


def _adopt(views: list[torch.Tensor]) -> torch.UntypedStorage:
    """A resizable copy of the views' storage, with every view rebound to it (identity kept)."""
    old = views[0].untyped_storage()
    if old.resizable():
        return old
    new = torch.UntypedStorage(old.nbytes(), device=old.device)
    torch.empty(0, dtype=torch.uint8, device=old.device).set_(new).copy_(
        torch.empty(0, dtype=torch.uint8, device=old.device).set_(old))
    with torch.no_grad():
        for t in views:
            t.set_(new, t.storage_offset(), t.size(), t.stride())
    return new


def _make_unit(name: str, component: str, kind: str, modules: list[torch.nn.Module], index: int = -1) -> Unit:
    tensors = _tensors(modules)
    storages = [_adopt(views) for views in _by_storage(tensors).values()]
    return Unit(name, component, kind, modules, storages, sum(s.nbytes() for s in storages), index, tensors)


def denoiser_blocks(denoiser: torch.nn.Module) -> list[torch.nn.Module]:
    blocks: list[torch.nn.Module] = []
    for attr in BLOCK_ATTRS:
        value = getattr(denoiser, attr, None)
        if isinstance(value, torch.nn.ModuleList):
            blocks.extend(value)
        elif isinstance(value, torch.nn.Module):
            blocks.append(value)
    return blocks


def resolve_units(pipe, denoiser: torch.nn.Module, mode: str, components: tuple[str, ...]) -> list[Unit]:
    """The units of ``pipe`` for ``mode``; raises ConfigError naming a component the pipeline lacks."""
    available = module_components(pipe)
    names = list(components) or list(available)
    missing = [n for n in names if n not in available]
    if missing:
        raise ConfigError(f"offload.components={list(components)!r}: {type(pipe).__name__} has no module "
                          f"component {missing[0]!r} (it has: {', '.join(available)})")
    units: list[Unit] = []
    for name in names:
        module = available[name]
        blocks = denoiser_blocks(module) if mode == "layerwise" and module is denoiser else []
        if not blocks:
            units.append(_make_unit(name, name, "component", list(module.modules())))
            continue
        inside = {id(m) for b in blocks for m in b.modules()}
        head_modules = [m for m in module.modules() if id(m) not in inside]
        units.append(_make_unit(f"{name}.head", name, "head", head_modules))
        for i, block in enumerate(blocks):
            units.append(_make_unit(f"{name}.block{i}", name, "block", list(block.modules()), index=i))
    _check_disjoint(units)
    return units


def _check_disjoint(units: list[Unit]) -> None:
    owner: dict[int, str] = {}
    for unit in units:
        for st in unit.storages:
            other = owner.setdefault(st.data_ptr(), unit.name)
            if other != unit.name:
                raise ConfigError(f"offload: {other} and {unit.name} share weights; offload neither or "
                                  "list them as one component")
