"""CFG parallelism: the rows of every denoiser call are split across the cfg group and gathered back.

With classifier-free guidance a denoiser call carries ``[uncond; cond]`` rows (SD) or ``[cond; null]``
rows (DiT), concatenated over requests. Every rank of the cfg group receives the SAME full call (all
ranks run the same pipeline code on the same inputs) and computes one contiguous chunk of rows::

    rows (B = 4)       rank 0 computes     rank 1 computes     all_gather → every rank returns
    [u1 c1 u2 c2]      [u1 c1]             [u2 c2]             [u1 c1 u2 c2]      (B = 4)
    [u c]              [u]                 [c]                 [u c]              (one request: CFG halves split)
    [a b c]            [a b]               [c c] (padded)      [a b c]            (odd B)
    [x]                [x]                 [x]                 no collective      (B < P, e.g. guidance 1)

Uneven batches are padded by repeating the last row so every rank runs ``ceil(B / P)`` rows and the
gather has equal shapes (no shape exchange, one collective per denoiser call). With fewer rows than
ranks every rank simply runs the whole call (same cost as a padded chunk, and no collective). Tensors whose dim 0
equals B are split (sample, encoder_hidden_states, class_labels, per-row timesteps, also inside
dicts/lists); everything else (0-d timesteps, scalars, None) is passed unchanged, and so are the keyword
arguments a family names ``per_token`` (FLUX's position ids: one row per token, which a row count could equal).
Per-row plans made for the full call (a LoRA row plan, models/lora) follow the rank's rows through the context
``around_local(rows)`` the family hands in, entered around the local call with the rank's row indices.

Installed by replacing the instance's ``forward``: the module stays in the pipeline, so its forward
hooks/pre-hooks fire exactly once per denoiser call, with the full batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any, ContextManager

import torch

from stage_runtime.distributed.comm import all_gather_cat, group_rank, group_size
from stage_runtime.errors import ConfigError

_MARK = "_diffstage_cfg_parallel"
_SAMPLE_KWARGS = ("sample", "hidden_states", "x")


def _batch_size(args: tuple, kwargs: dict) -> int | None:
    """Rows of the call: dim 0 of the sample (first positional tensor, or a known sample kwarg)."""
    candidates = [args[0]] if args else []
    candidates += [kwargs[k] for k in _SAMPLE_KWARGS if k in kwargs]
    for value in candidates:
        if isinstance(value, torch.Tensor) and value.ndim >= 1:
            return int(value.shape[0])
    return None


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


def _local_rows(tensor: torch.Tensor, batch: int, per_rank: int, rank: int) -> torch.Tensor:
    """This rank's contiguous chunk of a per-row tensor; past the end, the last row is repeated."""
    if tensor.ndim == 0 or tensor.shape[0] != batch:
        return tensor
    start, stop = rank * per_rank, (rank + 1) * per_rank
    if stop <= batch:
        return tensor[start:stop]
    index = torch.arange(start, stop, device=tensor.device).clamp_(max=batch - 1)
    return tensor.index_select(0, index)


def _gather_output(out: Any, batch: int, per_rank: int, group) -> Any:
    """All-gather every per-row output tensor and drop the padding; keep the model's return type."""

    def gather(t: torch.Tensor) -> torch.Tensor:
        if t.ndim == 0 or t.shape[0] != per_rank:
            raise RuntimeError(f"cfg-parallel denoiser output of shape {tuple(t.shape)} is not per-row "
                               f"({per_rank} local rows)")
        return all_gather_cat(t, group, dim=0)[:batch]

    if dataclasses.is_dataclass(out) and not isinstance(out, type):   # diffusers BaseOutput subclasses
        return type(out)(**{f.name: _map_tensors(getattr(out, f.name), gather) for f in dataclasses.fields(out)})
    return _map_tensors(out, gather)


def local_rows(batch: int, per_rank: int, rank: int, device: torch.device) -> torch.Tensor:
    """The call's row indices this rank computes (its chunk; past the end, the last row again)."""
    return torch.arange(rank * per_rank, (rank + 1) * per_rank, device=device).clamp_(max=batch - 1)


def enable_cfg_parallel(denoiser: torch.nn.Module, group, per_token: tuple[str, ...] = (),
                        around_local: Callable[[torch.Tensor], ContextManager] | None = None) -> None:
    """Split each denoiser call's rows across ``group`` and all_gather the outputs (no-op for group None); the
    keyword arguments named in ``per_token`` are never split; ``around_local(rows)`` (rows: this rank's row
    indices of the call) is entered around the local call.

    Every rank of ``group`` must make the same sequence of denoiser calls with the same shapes (true
    when all ranks run the same requests), which keeps the one all_gather per call symmetric.
    """
    if group is None:
        return
    if getattr(denoiser, _MARK, None) is not None:
        raise ConfigError(f"cfg parallel is already enabled on this {type(denoiser).__name__}")
    size, rank = group_size(group), group_rank(group)
    if size == 1:
        return
    original = denoiser.forward

    def forward(*args, **kwargs):
        batch = _batch_size(args, kwargs)
        if batch is None or batch < size:   # nothing to split: every rank computes it (no collective)
            return original(*args, **kwargs)
        per_rank = math.ceil(batch / size)

        def split(t: torch.Tensor) -> torch.Tensor:
            return _local_rows(t, batch, per_rank, rank)

        scope = contextlib.nullcontext() if around_local is None else around_local(
            local_rows(batch, per_rank, rank, torch.device("cpu")))
        with scope:
            out = original(*_map_tensors(args, split),
                           **{k: v if k in per_token else _map_tensors(v, split) for k, v in kwargs.items()})
        return _gather_output(out, batch, per_rank, group)

    forward.__wrapped__ = original  # type: ignore[attr-defined]
    denoiser.forward = forward
    setattr(denoiser, _MARK, group)
