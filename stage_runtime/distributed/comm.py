"""Guarded collectives: every torch.distributed call of the parallel model code goes through here.

A collective that fails or times out leaves the worker group in an unknown state (peers may be
blocked inside the same collective), so it is FATAL for the whole group: it surfaces as
:class:`CollectiveError`, which the runner must never treat as one request's error. The message
names the operation and the group's global ranks, e.g.
``all_gather on group ranks [0, 1] failed: Connection closed by peer``.

A compiled denoiser (stage_runtime.compilation) never traces one: each helper is a graph break
(``torch.compiler.disable``), so the same collectives run in the same order compiled or eager.

All helpers are symmetric: every rank of ``group`` must call them in the same order with tensors of
the same shape (callers make shape decisions from data every rank shares).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F

from stage_runtime.errors import WorkerFatalError

T = TypeVar("T")

# Bytes this process has sent per kind of collective (all_gather, all_to_all, all_reduce, ring send):
# the benchmark reads it per denoising step. Only the helpers below (and ring.py) count.
BYTES_SENT: Counter[str] = Counter()


def count_bytes(kind: str, tensor: torch.Tensor, times: int = 1) -> None:
    BYTES_SENT[kind] += tensor.numel() * tensor.element_size() * times


class CollectiveError(WorkerFatalError):
    """A torch.distributed collective failed or timed out: the worker group is dead (fail closed).

    A :class:`WorkerFatalError` (hence a RuntimeError): never one request's error. The rank reports it
    and exits; the executor latches dead, in-flight requests end with EngineDeadError, the stage exits 3.
    """


def group_label(group) -> str:
    """``ranks [0, 1]`` for a process group (or ``world`` for the default group)."""
    if group is None:
        return "world"
    try:
        return f"ranks {dist.get_process_group_ranks(group)}"
    except Exception:  # noqa: BLE001 - only used to build an error message
        return repr(group)


def guarded(op: str, group, fn: Callable[[], T]) -> T:
    """Run ``fn()`` (a torch.distributed call on ``group``); any failure → CollectiveError naming both."""
    try:
        return fn()
    except CollectiveError:
        raise
    except Exception as exc:  # gloo/NCCL raise RuntimeError, DistBackendError, DistNetworkError, timeouts
        detail = " ".join(str(exc).split())[:500] or type(exc).__name__
        raise CollectiveError(f"{op} on group {group_label(group)} failed: {detail}") from exc


def group_size(group) -> int:
    return guarded("get_world_size", group, lambda: dist.get_world_size(group))


def group_rank(group) -> int:
    return guarded("get_rank", group, lambda: dist.get_rank(group))


@torch.compiler.disable
def all_gather_cat(tensor: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's equally-shaped ``tensor`` along ``dim``, in group-rank order."""
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(group_size(group))]
    count_bytes("all_gather", tensor, len(parts) - 1)
    guarded("all_gather", group, lambda: dist.all_gather(parts, tensor, group=group))
    return torch.cat(parts, dim=dim)


@torch.compiler.disable
def all_gather_tokens(tensor: torch.Tensor, counts: list[int], group) -> torch.Tensor:
    """Concatenate every rank's (B, counts[rank], ...) ``tensor`` along dim 1, in group-rank order (uneven
    counts: each is padded to the longest for the exchange, then cut back)."""
    padded = F.pad(tensor, [0, 0] * (tensor.ndim - 2) + [0, max(counts) - tensor.shape[1]]).contiguous()
    parts = [torch.empty_like(padded) for _ in counts]
    count_bytes("all_gather", padded, len(parts) - 1)
    guarded("all_gather", group, lambda: dist.all_gather(parts, padded, group=group))
    return torch.cat([p[:, :n] for p, n in zip(parts, counts, strict=True)], dim=1)


@torch.compiler.disable
def all_to_all_dim0(tensor: torch.Tensor, group) -> torch.Tensor:
    """Exchange equal slices of dim 0: slice j goes to group rank j; result slice j came from rank j."""
    tensor = tensor.contiguous()
    out = torch.empty_like(tensor)
    count_bytes("all_to_all", tensor)
    guarded("all_to_all_single", group, lambda: dist.all_to_all_single(out, tensor, group=group))
    return out


@torch.compiler.disable
def all_to_all_rows(tensor: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Rows ``send[j]`` of dim 0 (in order) go to group rank j; ``recv[j]`` rows arrive from rank j, in rank order."""
    out = tensor.new_empty((sum(recv), *tensor.shape[1:]))
    tensor = tensor.contiguous()
    count_bytes("all_to_all", tensor)
    guarded("all_to_all_single", group, lambda: dist.all_to_all_single(out, tensor, recv, send, group=group))
    return out


@torch.compiler.disable
def all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` in place (every rank ends with the same sum) and return it."""
    count_bytes("all_reduce", tensor)
    guarded("all_reduce", group, lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group))
    return tensor
