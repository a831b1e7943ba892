"""LoraManager: one rank's resident LoRA adapters over the served pipeline's components.

``load`` reads a file through the served pipeline class's diffusers loader and checks it (models.lora.files),
then installs a :class:`LoraHook` on each module it targets — once per module, kept for the life of the
model (a hook with no plan is the base forward) — and gives the hook the adapter's factors. ``unload``
drops the factors. ``rows`` is the context a family puts around one fused call of a component; ``guard``
is the runner's promise check: while a request with adapters is in the call, every adapted module must
find a row plan set.

The engine owns the names, pinning, ``max_loras`` and who uses what (engine.lora_table); this class
only holds weights and applies them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from stage_runtime.errors import LoraLoadError
from stage_runtime.models.lora.files import LoraWeights, read_lora, resolve_path
from stage_runtime.models.lora.layer import LoraHook, LoraSlot, RowPlan


class LoraManager:
    def __init__(self, components: dict[str, torch.nn.Module], device: torch.device, pipeline_class: type,
                 model_dir: str | None = None,
                 flat_modules: dict[str, tuple[str, ...]] | None = None):
        self.pipeline_class = pipeline_class    # whose diffusers loader reads the files (its lora_state_dict)
        self.model_dir = model_dir      # a relative adapter path is inside it
        self.flat_modules = flat_modules or {}  # modules a file may not target (PipelineAdapter.lora_flat_modules)
        self.components = components
        self.device = device
        self.slots = {name: LoraSlot(name) for name in components}
        self.hooks: dict[tuple[str, str], LoraHook] = {}
        self.adapters: dict[str, LoraWeights] = {}

    def load(self, name: str, path: str) -> dict:
        """Read, check and hold adapter ``name``; its summary. LoraLoadError naming the first bad key."""
        if name in self.adapters:
            raise LoraLoadError(f"LoRA adapter {name!r} is already loaded on this rank")
        return self.add(read_lora(name, resolve_path(name, path, self.model_dir), self.components,
                                  self.pipeline_class, self.flat_modules))

    def add(self, weights: LoraWeights) -> dict:
        """Hold checked weights (``read_lora``'s): hook each module they target (once), give it the factors."""
        name = weights.name
        for component, modules in weights.modules.items():
            for module_path, factors in modules.items():
                hook = self.hooks.get((component, module_path))
                if hook is None:
                    hook = LoraHook(module_path, self.slots[component])
                    module = self.components[component].get_submodule(module_path)
                    if hasattr(module, "partial_hooks"):      # row-parallel: added before its all_reduce
                        module.partial_hooks.append(hook)
                    else:
                        module.register_forward_hook(hook)
                    self.hooks[(component, module_path)] = hook
                hook.factors[name] = factors
        self.adapters[name] = weights
        return weights.summary()

    def unload(self, name: str) -> bool:
        if self.adapters.pop(name, None) is None:
            return False
        for hook in self.hooks.values():
            hook.factors.pop(name, None)
        return True

    def list(self) -> list[dict]:
        return [w.summary() for w in self.adapters.values()]

    @contextlib.contextmanager
    def rows(self, component: str, row_sets: list[tuple]) -> Iterator[None]:
        """Set ``component``'s row plan for one fused call: ``row_sets[i]`` = row i's LoraRefs (or (name, scale)
        pairs), () for a plain row. Cleared on exit, whatever happens."""
        slot = self.slots[component]
        sets = [tuple((r.name, r.scale) if hasattr(r, "name") else tuple(r) for r in refs) for refs in row_sets]
        missing = sorted({n for s in sets for n, _ in s if n not in self.adapters})
        if missing:
            raise LoraLoadError(f"LoRA adapter(s) {', '.join(missing)} not loaded on this rank")
        slot.plan = RowPlan.of(sets, self.device)
        try:
            yield
        finally:
            slot.plan = None

    @contextlib.contextmanager
    def subset(self, module: torch.nn.Module, keep: torch.Tensor) -> Iterator[None]:
        """While part of a call runs on the rows ``keep`` only (the block cache's computing rows, a CFG-parallel
        rank's chunk), the plan of the component ``module`` belongs to follows them."""
        slot = next((self.slots[c] for c, m in self.components.items() if m is module), None)
        plan = None if slot is None else slot.plan
        if plan is None:
            yield
            return
        slot.plan = plan.subset(keep, self.device)
        try:
            yield
        finally:
            slot.plan = plan

    @contextlib.contextmanager
    def guard(self, with_adapters: bool) -> Iterator[None]:
        """Around one runner call: when a request in it carries adapters, an adapted module without a plan fails."""
        for slot in self.slots.values():
            slot.required = with_adapters
        try:
            yield
        finally:
            for slot in self.slots.values():
                slot.required, slot.plan = False, None

    def forward_calls(self) -> int:
        """Adapted forwards that applied an adapter, over every component (tests count them)."""
        return sum(slot.calls for slot in self.slots.values())


def build_lora_manager(adapter, config, device: torch.device) -> LoraManager | None:
    """The rank's manager over the family's LoRA components, with the stage's startup adapters loaded
    (a file that does not fit: LoraLoadError, so the stage exits 2). None when the family serves no LoRA."""
    components = {c: getattr(adapter.pipe, c) for c in adapter.lora_components
                  if getattr(adapter.pipe, c, None) is not None}
    if not components:
        if config.loras:
            raise LoraLoadError(f"loras: {type(adapter.pipe).__name__} serves no LoRA adapters "
                                f"(adapter {type(adapter).__name__} declares no LoRA components)")
        return None
    manager = LoraManager(components, device, type(adapter.pipe), config.model.path,
                          adapter.lora_flat_modules)
    for spec in config.loras:
        manager.load(spec.name, spec.path)
    return manager
