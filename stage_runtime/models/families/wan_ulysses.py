"""Wan's sequence-parallel hook (``WanAdapter.sequence_parallel``, models/families/wan.py; apart from it only so that
each stays within 400 lines). Sequence parallelism (Ulysses, ring, Ulysses × ring) for Wan's video DiT (``WanTransformer3DModel``: Wan 2.1,
both experts of Wan 2.2 A14B, TI2V-5B, Wan 2.1 I2V), over the shared distributed.usp.SequenceMesh.

A Wan block runs self-attention over the video tokens (3-D rotary positions), cross-attention from the video
tokens to the text (the T5 prompt; image tokens before it for image-to-video), then the MLP. Modulation, norms,
cross-attention and the MLP are token-local, so only the self-attention needs the other ranks::

    blocks[0] pre-hook        video tokens (B, S, C) → my tensor_split chunk; the rotary tables (1, S, 1, D) → my
                              rows; TI2V's per-token modulation (B, S, 6, C) → my rows (these two for every block)
    attn1 (self-attention)    WanUlyssesAttnProcessor: q, k, v of my tokens (q and k RMS-normed over all heads,
                              then turned by my rotary rows) → mesh.attention (Ulysses inside, ring across) → to_out
    attn2 (cross-attention)   the model's own processor: my tokens' queries against the text, whole on every rank
    blocks[-1] forward hook   my tokens → all_gather → (B, S, C): the output norm, modulation (per token for TI2V)
                              and projection run on every token, as unsharded

Chunks may be uneven (``torch.tensor_split``); a call with fewer video tokens than sp ranks runs unsharded on
every rank, through the model's own processor. The two experts of Wan 2.2 are two transformers, each sharded
with its own hooks over the same mesh; the hooks, the shard state and validate-then-install are
distributed/sequence_shard.py's.
"""

from __future__ import annotations

import torch

from stage_runtime.distributed import sequence_shard
from stage_runtime.distributed.sequence_shard import Shard, ShardState, Sharded, check_ulysses_heads
from stage_runtime.distributed.ulysses_joint import chunk_sizes
from stage_runtime.distributed.usp import SequenceMesh
from stage_runtime.errors import ConfigError

_TRANSFORMER = "WanTransformer3DModel"
_PROCESSOR = "WanAttnProcessor"
_BLOCK_ARGS = ("hidden_states", "encoder_hidden_states", "temb", "rotary_emb")   # WanTransformerBlock.forward


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding, as WanAttnProcessor applies it: each head's channel pairs (2i, 2i+1) of x
    (B, S, H, D) turned by the angles of the tables' rows (1, S, 1, D); the result in x's dtype."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out


class WanUlyssesAttnProcessor:
    """The self-attention (``attn1``) of one Wan block from my chunk of the video tokens (see the module
    docstring); unsharded calls go to the model's own processor."""

    def __init__(self, mesh: SequenceMesh, state: ShardState, original):
        self.mesh, self.state, self.original = mesh, state, original

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, rotary_emb=None, **kwargs) -> torch.Tensor:
        shard = self.state.shard
        if shard is None:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)
        if encoder_hidden_states is not None or attention_mask is not None or kwargs:
            raise RuntimeError("Wan sequence parallel: the sharded self-attention got encoder states, a mask or "
                               f"other arguments ({', '.join(kwargs)})")
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (attn.norm_q(query), attn.norm_k(key), value))
        if rotary_emb is not None:                             # my rows of the tables (the split rule's)
            query, key = rotate(query, *rotary_emb), rotate(key, *rotary_emb)
        out = self.mesh.attention(query, key, value, shard.image).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def split_video(mesh: SequenceMesh, args: tuple, kwargs: dict) -> Shard | None:
    """The split rule of a Wan block's call (positional, as WanTransformer3DModel makes it, or keywords): my
    chunk of the video tokens, my rows of the rotary tables and of TI2V's per-token modulation (``temb``
    (B, S, 6, C); Wan 2.1/2.2's (B, 6, C) is per row) for this block and every later one. None (unsharded)
    when there are fewer video tokens than sp ranks."""
    call = {**dict(zip(_BLOCK_ARGS, args)), **kwargs}
    video, degree, rank = call["hidden_states"], mesh.sp_size, mesh.sp_rank
    if video.shape[1] < degree:
        return None

    def mine(t: torch.Tensor) -> torch.Tensor:
        return torch.tensor_split(t, degree, dim=1)[rank]

    local = {"hidden_states": mine(video)}
    if call.get("rotary_emb") is not None:
        local["rotary_emb"] = tuple(mine(table) for table in call["rotary_emb"])
    if call["temb"].ndim == 4:
        local["temb"] = mine(call["temb"])
    where = {name: i for i, name in enumerate(_BLOCK_ARGS[:len(args)])}      # positional: by index
    changes = {where.get(name, name): value for name, value in local.items()}
    later = {key: value for key, value in changes.items() if key not in (0, "hidden_states")}
    return Shard(*sequence_shard.override(args, kwargs, changes), image=chunk_sizes(video.shape[1], degree),
                 later=later)


def enable_wan_sequence_parallel(denoiser: torch.nn.Module, ulysses_degree: int, make_mesh) -> None:
    """Shard the video tokens of every WanTransformer3DModel in ``denoiser`` (Wan 2.2: both experts) over the
    mesh ``make_mesh()`` builds once everything is validated (ConfigError where it cannot: a self-attention
    processor other than diffusers' WanAttnProcessor, fused projections, heads ``ulysses_degree`` does not divide)."""
    sequence_shard.install(denoiser, make_mesh, lambda: _plan(denoiser, ulysses_degree))


def _plan(denoiser: torch.nn.Module, degree: int) -> list[Sharded]:
    targets = [(name or type(denoiser).__name__, m) for name, m in denoiser.named_modules()
               if type(m).__name__ == _TRANSFORMER and len(getattr(m, "blocks", ())) > 0]
    if not targets:
        raise ConfigError(f"Wan sequence parallel: {type(denoiser).__name__} has no {_TRANSFORMER} blocks to shard")
    return [_sharded(name, transformer, degree) for name, transformer in targets]


def _sharded(name: str, transformer: torch.nn.Module, degree: int) -> Sharded:
    blocks = list(transformer.blocks)
    for i, block in enumerate(blocks):
        attn, where = block.attn1, f"{name}.blocks.{i}.attn1"
        if type(attn.processor).__name__ != _PROCESSOR or attn.is_cross_attention:
            raise ConfigError(f"Wan sequence parallel: {where} uses {type(attn.processor).__name__}; only the "
                              f"self-attention of diffusers' {_PROCESSOR} is sharded")
        if getattr(attn, "fused_projections", False):
            raise ConfigError(f"Wan sequence parallel: {where} has fused q/k/v projections, which it does not implement")
        check_ulysses_heads(attn.heads, degree)
    return Sharded(name, blocks, blocks[-1], [block.attn1 for block in blocks],
                   lambda mesh, state, attn: WanUlyssesAttnProcessor(mesh, state, attn.processor), split_video)
