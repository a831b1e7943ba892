"""CFG parallelism for a denoiser that takes its rows as lists (Z-Image: ``transformer(x, t, cap_feats)`` with
``x`` a list of (C, F, h, w) latents, ``cap_feats`` a list of (T_i, D) captions of their own lengths, ``t`` a
(B,) tensor) and returns a list of per-row outputs of one shape.

As distributed/cfg_parallel.py does for tensors: every rank of the cfg group gets the same full call and
computes one contiguous chunk of ``ceil(B / P)`` rows (past the end, the last row again), the chunks are
gathered (stacked, one all_gather) and every rank returns all B rows, in the model's return type. With fewer
rows than ranks every rank runs the whole call (no collective). Installed over the instance's ``forward``, so
hooks on the module fire once per call with the full rows; per-row plans made for the full call (LoRA) follow the
rank's rows through ``around_local(rows)``, as in distributed/cfg_parallel.py.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import ContextManager

import torch

from stage_runtime.distributed.comm import all_gather_cat, group_rank, group_size
from stage_runtime.errors import ConfigError

_MARK = "_diffstage_cfg_parallel"


def _rows(value, batch: int, index: list[int]):
    """This rank's rows of a per-row list or tensor (length / dim 0 = ``batch``); anything else as it is."""
    if isinstance(value, list) and len(value) == batch:
        return [value[i] for i in index]
    if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == batch:
        return value[torch.tensor(index, device=value.device)]
    return value


def enable_list_cfg_parallel(denoiser: torch.nn.Module, group,
                             around_local: Callable[[torch.Tensor], ContextManager] | None = None) -> None:
    """Split the rows of each call of ``denoiser`` (its first argument: a list) across ``group`` and gather the
    per-row outputs (no-op for group None or one rank); ``around_local(rows)`` is entered around the local call.
    Every rank makes the same calls (same requests)."""
    if group is None:
        return
    if getattr(denoiser, _MARK, None) is not None:
        raise ConfigError(f"cfg parallel is already enabled on this {type(denoiser).__name__}")
    size, rank = group_size(group), group_rank(group)
    if size == 1:
        return
    original = denoiser.forward

    def forward(x, *args, **kwargs):
        batch = len(x)
        if batch < size:
            return original(x, *args, **kwargs)
        per_rank = math.ceil(batch / size)
        index = [min(i, batch - 1) for i in range(rank * per_rank, (rank + 1) * per_rank)]
        scope = contextlib.nullcontext() if around_local is None else around_local(torch.tensor(index))
        with scope:
            out = original([x[i] for i in index], *(_rows(a, batch, index) for a in args),
                           **{k: _rows(v, batch, index) for k, v in kwargs.items()})
        rows = out[0] if isinstance(out, tuple) else out.sample
        if len(rows) != per_rank:
            raise RuntimeError(f"cfg-parallel denoiser returned {len(rows)} rows for {per_rank} local rows")
        gathered = list(all_gather_cat(torch.stack(rows), group, dim=0)[:batch].unbind(0))
        if isinstance(out, tuple):
            return (gathered, *out[1:])
        out.sample = gathered
        return out

    forward.__wrapped__ = original  # type: ignore[attr-defined]
    denoiser.forward = forward
    setattr(denoiser, _MARK, group)
