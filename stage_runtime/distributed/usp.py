"""Unified sequence parallelism (USP): Ulysses inside, ring across, over one sequence-parallel group.

The sp group of SP = U × R ranks holds the token sequence cut into SP chunks; sp rank s = u + U·r holds
chunk s (the rank layout of stage_runtime.config; groups.sp_subgroup_ranks). One attention call, from
the local q, k, v of chunk s (B, S_s, H, D)::

    Ulysses (U > 1), inside the group of r     all_to_all: my tokens × all heads → the U chunks of r × H/U heads
    ring (R > 1), across the groups            ring_attention over the R super-chunks (k/v circulate)
                                               (R = 1: plain SDPA over the group's tokens)
    Ulysses back                               all_to_all: → my tokens × all heads

Chunks may be uneven: ``counts[s]`` is sp rank s's token count, which every rank derives from the same
shapes; the all_to_all carries per-rank counts and the ring receives blocks of the sender's length. So
sequence lengths not divisible by SP are neither padded nor refused. The order in which keys arrive does
not matter; an optional key mask (Qwen-Image's padded text) is given over every rank's tokens in sp-rank
order, the same on every rank, so each Ulysses group and ring block cuts its own keys' part of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stage_runtime.distributed.comm import all_to_all_rows, group_rank, group_size
from stage_runtime.distributed.ring import ring_attention
from stage_runtime.errors import ConfigError


@dataclass(frozen=True)
class SequenceMesh:
    """One rank's sequence-parallel groups (a group is None where its size is 1)."""

    sp_group: object
    sp_size: int
    sp_rank: int
    ulysses_group: object = None
    ulysses_size: int = 1
    ring_group: object = None
    ring_size: int = 1

    @classmethod
    def ulysses(cls, group, degree: int) -> SequenceMesh:
        """Ulysses only: the whole sp group is one Ulysses group (ConfigError if it has the wrong size)."""
        if group is None or group_size(group) != degree:
            raise ConfigError(f"ulysses_degree={degree} needs a sequence-parallel group of {degree} ranks")
        return cls(group, degree, group_rank(group), group, degree)

    @classmethod
    def from_groups(cls, groups, parallel) -> SequenceMesh:
        """The mesh of a ParallelGroups (groups.init_distributed) for ``parallel``'s ulysses × ring."""
        u, r = parallel.ulysses_degree, parallel.ring_degree
        for name, group, size in (("sequence-parallel", groups.sp_group, u * r), ("Ulysses", groups.ulysses_group, u),
                                  ("ring", groups.ring_group, r)):
            if size > 1 and (group is None or group_size(group) != size):
                raise ConfigError(f"ulysses_degree={u} × ring_degree={r} needs a {name} group of {size} ranks")
        return cls(groups.sp_group, u * r, groups.coords.sp, groups.ulysses_group, u, groups.ring_group, r)

    @property
    def ring_rank(self) -> int:
        return self.sp_rank // self.ulysses_size

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  counts: list[int], key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of my tokens over every sp rank's tokens: local (B, S_s, H, D) q/k/v → (B, S_s, H, D).
        ``key_mask`` (B, sum(counts)) bool: which of the tokens of sp ranks 0, 1, … may be attended to."""
        if len(counts) != self.sp_size or counts[self.sp_rank] != query.shape[1]:
            raise RuntimeError(f"sequence parallel: {query.shape[1]} local tokens do not match the plan {counts}")
        u = self.ulysses_size
        mine = counts[self.ring_rank * u:(self.ring_rank + 1) * u]               # my Ulysses group's chunks
        ring_counts = [sum(counts[j * u:(j + 1) * u]) for j in range(self.ring_size)]
        if u == 1:
            q, k, v = (t.transpose(1, 2) for t in (query, key, value))           # (B, H, S_s, D)
            return self._core(q, k, v, ring_counts, key_mask).transpose(1, 2)
        batch, tokens, heads, head_dim = query.shape
        per = heads // u
        qkv = torch.stack([query, key, value]).view(3, batch, tokens, u, per, head_dim)
        rows = qkv.permute(3, 2, 0, 1, 4, 5).reshape(u * tokens, 3, batch, per, head_dim)  # head group j → rank j
        full = all_to_all_rows(rows, [tokens] * u, mine, self.ulysses_group)              # (S_r, 3, B, H/U, D)
        q, k, v = full.permute(1, 2, 3, 0, 4).unbind(0)                                   # (B, H/U, S_r, D)
        out = self._core(q, k, v, ring_counts, key_mask)                                  # (B, H/U, S_r, D)
        back = all_to_all_rows(out.permute(2, 0, 1, 3), mine, [tokens] * u, self.ulysses_group)
        return back.view(u, tokens, batch, per, head_dim).permute(2, 1, 0, 3, 4).reshape(batch, tokens, heads,
                                                                                         head_dim)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring_counts: list[int],
              key_mask: torch.Tensor | None) -> torch.Tensor:
        if self.ring_size == 1:                 # one block: every key, in sp-rank order
            mask = None if key_mask is None else key_mask[:, None, None, :]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
        return ring_attention(q, k, v, self.ring_group, ring_counts, key_mask)
