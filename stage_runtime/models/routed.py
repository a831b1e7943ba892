"""A denoiser made of parts between which each forward's rows are routed (Wan 2.2's two experts).

One forward is one denoising step over every scheduled row; the subclass's ``forward`` says which part runs which
rows (``run_routes``). Per-row features wrap each part's call with the rows it gets (``around_each``): the LoRA row
plan of that part's pipeline component, the block cache's session over that part's blocks. So a part never sees a
plan made for the whole forward, and a request's block-cache residual never crosses from one part to the other.

    rows of the forward    [ A (high noise) | B (low noise) | C (high noise) ]
    transformer            A's and C's rows, renumbered 0..     around each: wrap("transformer", rows of A and C)
    transformer_2          B's rows                             around each: wrap("transformer_2", rows of B)
    output                 each part's rows put back in place

When one part runs every row it gets them as they are (``rows`` None): no copy, the forward is the part's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import ContextManager

import torch

# (part name, the forward's row indices it runs, ascending, or None for all rows) → a context around that call
PartWrap = Callable[[str, torch.Tensor | None], ContextManager]


class RoutedDenoiser(torch.nn.Module):
    part_names: tuple[str, ...] = ()          # attributes holding the parts (a part may be None: absent)

    def __init__(self) -> None:
        super().__init__()
        self._wraps: list[PartWrap] = []
        self.local: torch.Tensor | None = None    # the rows of the call this rank runs (CFG parallel), None: all

    @contextlib.contextmanager
    def local_rows(self, rows: torch.Tensor) -> Iterator[None]:
        """While inside, the forward's rows are the rows ``rows`` of the call a wrap's plan was made for (a
        CFG-parallel rank's chunk): ``on_local`` maps that plan's rows to them."""
        self.local = rows
        try:
            yield
        finally:
            self.local = None

    def on_local(self, items: list) -> list:
        """A list made for the whole call, one entry per row, cut to the rows this rank runs."""
        return items if self.local is None else [items[i] for i in self.local.tolist()]

    def parts(self) -> dict[str, torch.nn.Module]:
        """The parts present, by name (their pipeline component names)."""
        return {name: part for name in self.part_names if (part := getattr(self, name, None)) is not None}

    @contextlib.contextmanager
    def around_each(self, wrap: PartWrap) -> Iterator[None]:
        """While inside, ``wrap(part, rows)`` is entered around every call of a part (in the order the wraps came)."""
        self._wraps.append(wrap)
        try:
            yield
        finally:
            self._wraps.remove(wrap)

    def run_routes(self, inputs: dict[str, torch.Tensor | None], routes: list[tuple[str, torch.Tensor | None]],
                   **kwargs) -> torch.Tensor:
        """Each ``(part, rows)`` of ``routes`` on its rows of the per-row ``inputs``; the outputs in row order."""
        if len(routes) == 1 and routes[0][1] is None:
            return self._call(routes[0][0], None, inputs, kwargs)
        out = None
        for name, rows in routes:
            selected = {k: None if v is None else v.index_select(0, rows) for k, v in inputs.items()}
            part = self._call(name, rows, selected, kwargs)
            if out is None:
                total = sum(len(r) for _, r in routes)
                out = part.new_empty((total, *part.shape[1:]))
            out.index_copy_(0, rows, part)
        return out

    def _call(self, name: str, rows: torch.Tensor | None, inputs: dict, kwargs: dict) -> torch.Tensor:
        with contextlib.ExitStack() as stack:
            for wrap in list(self._wraps):
                stack.enter_context(wrap(name, rows))
            return getattr(self, name)(**inputs, **kwargs, return_dict=False)[0]
