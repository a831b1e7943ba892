"""The unfused per-row LoRA layer: a forward hook on each adapted Linear / Conv2d.

    y = base(x)                                   the module's own forward, weights never touched
    y[rows of set S] += Σ_{(i, s_i) in S} s_i · scaling_i · (B_i(A_i x[rows of S]) + b_i)    in S's order
                                                  (b_i: the adapter's lora_B.bias, zero when it has none)

Which rows carry which adapters is plain data — a :class:`RowPlan` — that the family's code sets on the
component's :class:`LoraSlot` right before one fused call and clears right after (``LoraManager.rows``).
Rows without adapters add nothing, so a plain request's rows are exactly the base model, bitwise, and
requests with different adapter sets share one forward. A row count that differs from the plan's, or an
adapted module called with no plan while a request with adapters is in the call, is an error, never a
silent base-model output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from stage_runtime.models.lora.files import LoraFactors

AdapterSet = tuple[tuple[str, float], ...]     # ((adapter name, request scale), ...) in application order


class LoraRowsError(RuntimeError):
    """An adapted module ran without the rows its call needed (a family path that did not set them)."""


@dataclass(frozen=True)
class RowPlan:
    """One fused call's rows: ``groups`` = (row indices or None for all rows, the set those rows carry)."""

    rows: int
    groups: tuple[tuple[torch.Tensor | None, AdapterSet], ...]

    @classmethod
    def of(cls, row_sets: list[AdapterSet], device: torch.device) -> "RowPlan":
        by_set: dict[AdapterSet, list[int]] = {}
        for i, s in enumerate(row_sets):
            if s:
                by_set.setdefault(s, []).append(i)
        groups = tuple((None if len(idx) == len(row_sets) else torch.tensor(idx, device=device, dtype=torch.long), s)
                       for s, idx in by_set.items())
        return cls(len(row_sets), groups)


    def subset(self, keep: torch.Tensor, device: torch.device) -> "RowPlan":
        """The plan for the rows ``keep`` (indices into this plan's rows, renumbered 0..; a row may come twice: CFG
        parallel pads a rank's chunk by repeating the last row)."""
        sets: list[AdapterSet] = [()] * self.rows
        for idx, adapter_set in self.groups:
            for row in (range(self.rows) if idx is None else idx.tolist()):
                sets[row] = adapter_set
        return RowPlan.of([sets[row] for row in keep.tolist()], device)


@dataclass
class LoraSlot:
    """One component's row plan for the call in flight (None between calls) and the runner's guard."""

    component: str
    plan: RowPlan | None = None
    required: bool = False          # a request in the running call carries adapters: a plan must be set
    calls: int = 0                  # adapted forwards that applied at least one adapter (tests count them)


@dataclass
class LoraHook:
    """Installed once per adapted module (``register_forward_hook``); holds each loaded adapter's factors."""

    module_path: str
    slot: LoraSlot
    factors: dict[str, LoraFactors] = field(default_factory=dict)

    def __call__(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        plan = self.slot.plan
        if plan is None:
            if self.slot.required:
                raise LoraRowsError(f"{self.slot.component}.{self.module_path} ran without LoRA rows "
                                    "while a request with adapters is in the call")
            return output
        x = args[0]
        if x.shape[0] != plan.rows:
            raise LoraRowsError(f"{self.slot.component}.{self.module_path}: {x.shape[0]} rows in the call, "
                                f"the LoRA row plan has {plan.rows}")
        applied = False
        for idx, adapter_set in plan.groups:
            part = output if idx is None else output.index_select(0, idx)
            xs = x if idx is None else x.index_select(0, idx)
            for name, scale in adapter_set:
                f = self.factors.get(name)
                if f is None:                        # this adapter does not target this module
                    continue
                part = part + self._delta(module, xs, f) * (scale * f.scaling)
                applied = True
            output = part if idx is None else output.index_copy(0, idx, part)
        self.slot.calls += applied
        return output

    @staticmethod
    def _delta(module: torch.nn.Module, x: torch.Tensor, f: LoraFactors) -> torch.Tensor:
        if isinstance(module, torch.nn.Conv2d):
            return F.conv2d(F.conv2d(x, f.a, stride=module.stride, padding=module.padding), f.b, f.bias)
        return F.linear(F.linear(x, f.a), f.b, f.bias)
