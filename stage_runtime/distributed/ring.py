"""Ring attention: every rank keeps its queries; the key/value blocks travel around the ring group.

With R ranks, rank r holds the q, k, v of its own token block. In R steps each rank attends its queries
to one key/value block and passes that block on (send to r+1, receive from r-1, overlapped with the
block's compute); after R steps every query has seen every key exactly once::

    step      0        1        2   ...          rank r computes softmax(q_r · k_j) v_j for block j = r - step
    rank 0   kv0      kv3      kv2               and sends kv_j to rank r+1 while it computes
    rank 1   kv1      kv0      kv3
    rank 2   kv2      kv1      kv0

The partial results are merged with the online-softmax rule in float32, in its log-sum-exp form: each
block gives its normalised output o_j and the log-sum-exp L_j of its scores (the block's max plus the log
of its sum); the running pair (o, L) becomes L' = log(e^L + e^L_j), o' = o·e^(L - L') + o_j·e^(L_j - L').
The result is the exact softmax attention over all keys (up to float32 rounding), so key order does not
matter and blocks may have different lengths: ``counts[j]`` is rank j's key count, which every rank
derives from shapes they all share (no size exchange).

One send/recv pair per step (``batch_isend_irecv``: gloo here, NCCL on GPUs) carries k and v stacked. gloo's
send and recv read and write host memory only, so over a gloo group the block travels through a host copy
(:func:`staging_device`; a no-op on CPU): ranks sharing one GPU over gloo (``bench/gpu_check.py``) run the same ring.
Failures surface as CollectiveError (comm.guarded): a dead ring is fatal for the worker group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from stage_runtime.distributed.comm import count_bytes, group_rank, group_size, guarded


def staging_device(device: torch.device, group) -> torch.device:
    """Where a ring message lives while it travels: the host over a gloo group (its send/recv take host memory
    only), the block's own device otherwise (NCCL)."""
    backend = guarded("get_backend", group, lambda: dist.get_backend(group))
    return torch.device("cpu") if backend == "gloo" else device


@torch.compiler.disable
def _start_exchange(block: torch.Tensor, shape: tuple[int, ...], group, send_to: int, recv_from: int,
                    staging: torch.device) -> tuple[list, torch.Tensor]:
    """Send ``block``, receive a block of ``shape``: (requests to wait for, the buffer the block arrives in)."""
    count_bytes("ring_send", block)
    outgoing = block.to(staging)                                      # the same tensor when already there
    incoming = torch.empty(shape, dtype=block.dtype, device=staging)
    ops = [dist.P2POp(dist.isend, outgoing, send_to, group), dist.P2POp(dist.irecv, incoming, recv_from, group)]
    return guarded("batch_isend_irecv", group, lambda: dist.batch_isend_irecv(ops)), incoming


@torch.compiler.disable
def _finish_exchange(requests: list, group) -> None:
    for request in requests:
        guarded("batch_isend_irecv (wait)", group, request.wait)


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group,
                   counts: list[int], key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of local ``query`` (B, H, S_q, D) over the keys of every rank of ``group``.

    ``key``/``value`` (B, H, counts[rank], D) are this rank's block; ``counts[j]`` is rank j's. ``key_mask``
    (B, sum(counts)) bool, the same on every rank: which keys of all the blocks, in rank order, may be
    attended to (None: all). Default scale 1/sqrt(D). Returns (B, H, S_q, D) in ``query``'s dtype.
    """
    size, rank = group_size(group), group_rank(group)
    if len(counts) != size or counts[rank] != key.shape[2]:
        raise RuntimeError(f"ring attention: {key.shape[2]} local keys do not match the plan {counts} (rank {rank})")
    send_to = guarded("get_global_rank", group, lambda: dist.get_global_rank(group, (rank + 1) % size))
    recv_from = guarded("get_global_rank", group, lambda: dist.get_global_rank(group, (rank - 1) % size))
    shape = (*query.shape[:-1], 1)
    lse = torch.full(shape, float("-inf"), dtype=torch.float32, device=query.device)
    acc = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    block = torch.stack([key, value]).contiguous()                   # (2, B, H, S_k, D): one message
    starts = [sum(counts[:j]) for j in range(size)]
    staging = staging_device(block.device, group)
    for step in range(size):
        pending, incoming = [], None
        if step < size - 1:
            source = (rank - step - 1) % size                         # whose block arrives next
            shape = (2, *key.shape[:2], counts[source], key.shape[-1])
            pending, incoming = _start_exchange(block, shape, group, send_to, recv_from, staging)
        owner = (rank - step) % size                                  # whose block this is
        mask = None if key_mask is None else key_mask[:, starts[owner]:starts[owner] + counts[owner]]
        out, block_lse = block_attention(query, block[0], block[1], mask)
        new_lse = torch.logaddexp(lse, block_lse)
        acc = acc * torch.exp(lse - new_lse) + out * torch.exp(block_lse - new_lse)
        lse = new_lse
        if pending:
            _finish_exchange(pending, group)
            block = incoming.to(block.device)
    return acc.to(query.dtype)


def block_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    key_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``query`` over one key block: (output, log-sum-exp of the scores (B, H, S_q, 1)),
    both float32. CPU: torch's fused flash kernel, which returns the log-sum-exp (a key mask goes in as an
    additive one; ~18x faster than explicit scores for HunyuanVideo-1.5's 2k-token masked context); elsewhere
    the scores are formed explicitly in float32. Keys where ``key_mask`` (B, S_k) is False score the lowest
    float (not -inf: a block masked whole then weighs nothing in the merge instead of making NaN)."""
    if query.device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        mask = None if key_mask is None else torch.zeros(key_mask.shape, dtype=query.dtype, device=query.device) \
            .masked_fill_(~key_mask, torch.finfo(query.dtype).min)[:, None, None, :]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, attn_mask=mask)[:2]
        return out.float(), lse.float().unsqueeze(-1)
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * query.shape[-1] ** -0.5
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], torch.finfo(torch.float32).min)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.matmul(torch.exp(scores - lse), value.float()), lse

