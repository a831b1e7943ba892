"""Offload plan: which weights form which unit (pure discovery over a loaded pipeline; moves nothing).

A *unit* is the smallest thing the residency manager moves: a whole component (``model`` mode), or —
``layerwise`` mode, for the denoiser (each of Wan 2.2's two experts) — each block plus one ``head`` unit holding
the denoiser weights outside its blocks (embeddings, norms, projections). A unit is a list of *storage groups*:
the distinct storages under its parameters and buffers, each with every tensor viewing it and that view's
geometry (offset, size, stride). The tiers move a group's storage as raw bytes (bitwise, any dtype, tied or
strided views included) and rebind the very same tensor objects to it. A storage belongs to one unit only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stage_runtime.errors import ConfigError

# Denoiser attributes holding its blocks, in execution order (UNet: down, mid, up; DiT/Flux-like: blocks).
# The default when the model's adapter does not declare its own (``PipelineAdapter.block_lists``).
BLOCK_ATTRS = ("down_blocks", "mid_block", "up_blocks", "transformer_blocks", "single_transformer_blocks", "blocks")


@dataclass(eq=False)
class View:
    tensor: torch.Tensor
    offset: int
    size: torch.Size
    stride: tuple[int, ...]


@dataclass(eq=False)
class StorageGroup:
    nbytes: int
    device: torch.device
    views: list[View]


@dataclass(eq=False)
class Unit:
    name: str                              # "text_encoder", "vae", "transformer.head", "unet.block3"
    component: str                         # the pipeline component it belongs to
    kind: str                              # "component" | "head" | "block"
    modules: list[torch.nn.Module]         # modules whose forward uses the unit (hooks go here)
    groups: list[StorageGroup]             # distinct storages it owns, with their views
    index: int = -1                        # block position in execution order (blocks only)
    nbytes: int = field(init=False)        # bytes when materialised

    def __post_init__(self) -> None:
        self.nbytes = sum(g.nbytes for g in self.groups)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [v.tensor for g in self.groups for v in g.views]

    def materialised_bytes(self) -> int:
        """Bytes its tensors hold right now (distinct storages, actual sizes)."""
        sizes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.tensors}
        return sum(n for ptr, n in sizes.items() if ptr)


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


def _make_unit(name: str, component: str, kind: str, modules: list[torch.nn.Module], index: int = -1) -> Unit:
    groups: dict[int, StorageGroup] = {}
    for t in _tensors(modules):
        st = t.untyped_storage()
        if not st.nbytes():
            continue
        group = groups.setdefault(st.data_ptr(), StorageGroup(st.nbytes(), t.device, []))
        group.views.append(View(t, t.storage_offset(), t.size(), t.stride()))
    return Unit(name, component, kind, modules, list(groups.values()), index)


def denoiser_blocks(denoiser: torch.nn.Module, block_lists: tuple[str, ...] | None = None) -> list[torch.nn.Module]:
    """The denoiser's blocks in execution order, from ``block_lists`` (a family's declaration: every named
    attribute must exist) or, undeclared, from whichever of BLOCK_ATTRS it has."""
    if block_lists is not None:
        missing = [attr for attr in block_lists if getattr(denoiser, attr, None) is None]
        if missing:
            raise ConfigError(f"offload.mode='layerwise': {type(denoiser).__name__} has no block list "
                              f"{missing[0]!r} (its adapter declares {list(block_lists)})")
    blocks: list[torch.nn.Module] = []
    for attr in BLOCK_ATTRS if block_lists is None else block_lists:
        value = getattr(denoiser, attr, None)
        if isinstance(value, torch.nn.ModuleList):
            blocks.extend(value)
        elif isinstance(value, torch.nn.Module):
            blocks.append(value)
    return blocks


def resolve_units(pipe, denoiser: torch.nn.Module | tuple[torch.nn.Module, ...], mode: str,
                  components: tuple[str, ...], block_lists: tuple[str, ...] | None = None) -> list[Unit]:
    """The units of ``pipe`` for ``mode``; raises ConfigError naming a component the pipeline lacks. ``denoiser``
    is the component ``layerwise`` splits into blocks, or a tuple of them (Wan 2.2's two experts: each its own
    head and blocks)."""
    split = {id(m) for m in (denoiser if isinstance(denoiser, tuple) else (denoiser,))}
    available = module_components(pipe)
    names = list(components) or list(available)
    missing = [n for n in names if n not in available]
    if missing:
        raise ConfigError(f"offload.components={list(components)!r}: {type(pipe).__name__} has no module "
                          f"component {missing[0]!r} (it has: {', '.join(available)})")
    units: list[Unit] = []
    for name in names:
        module = available[name]
        blocks = denoiser_blocks(module, block_lists) if mode == "layerwise" and id(module) in split else []
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
        for group in unit.groups:
            other = owner.setdefault(group.views[0].tensor.untyped_storage().data_ptr(), unit.name)
            if other != unit.name:
                raise ConfigError(f"offload: {other} and {unit.name} share weights; offload neither or "
                                  "list them as one component")
