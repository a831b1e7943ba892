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

Wan VACE (``WanVACETransformer3DModel``) runs its control branch first: each VACE block attends over the control
tokens (the video's grid, the same rotary tables) and hands a hint to the Wan block of its layer, added to that
block's output. Both are sharded alike, so a hint is my chunk of the same tokens::

    vace_blocks[0] pre-hook   my chunk of the video and of the control tokens, my rotary rows; later VACE blocks
                              get my rows of the (unused) video and the tables; their control is the chunk the
                              block before made, and their hints stay sharded
    blocks[0] pre-hook        as above; each hint is added to my chunk after its block
    norm_out forward hook     the gather (not blocks[-1]'s: the last layer's hint is added after that block)
"""

from __future__ import annotations

import torch

from stage_runtime.distributed import sequence_shard
from stage_runtime.distributed.sequence_shard import Shard, ShardState, Sharded, check_ulysses_heads
from stage_runtime.distributed.ulysses_joint import chunk_sizes
from stage_runtime.distributed.usp import SequenceMesh
from stage_runtime.errors import ConfigError

_TRANSFORMERS = ("WanTransformer3DModel", "WanVACETransformer3DModel")
_PROCESSOR = "WanAttnProcessor"
_BLOCK_ARGS = ("hidden_states", "encoder_hidden_states", "temb", "rotary_emb")   # WanTransformerBlock.forward
_VACE_BLOCK_ARGS = ("hidden_states", "encoder_hidden_states", "control_hidden_states", "temb", "rotary_emb")


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
    return _split(mesh, args, kwargs, _BLOCK_ARGS, carried="hidden_states")


def split_control(mesh: SequenceMesh, args: tuple, kwargs: dict) -> Shard | None:
    """The split rule of a VACE block's call: my chunk of the video (what the first block adds to its control
    input) and of the control tokens, my rotary rows; later VACE blocks carry the control chunk on."""
    return _split(mesh, args, kwargs, _VACE_BLOCK_ARGS, carried="control_hidden_states")


def _split(mesh: SequenceMesh, args: tuple, kwargs: dict, names: tuple[str, ...], carried: str) -> Shard | None:
    """My chunk of every token stream of a block call named ``names`` (both by the video's token count), my rows of
    the tables; every later block gets them too but ``carried``, the stream each block hands to the next."""
    call = {**dict(zip(names, args)), **kwargs}
    video, degree, rank = call["hidden_states"], mesh.sp_size, mesh.sp_rank
    if video.shape[1] < degree:
        return None

    def mine(t: torch.Tensor) -> torch.Tensor:
        return torch.tensor_split(t, degree, dim=1)[rank]

    local = {name: mine(call[name]) for name in ("hidden_states", "control_hidden_states") if name in call}
    if call.get("rotary_emb") is not None:
        local["rotary_emb"] = tuple(mine(table) for table in call["rotary_emb"])
    if call["temb"].ndim == 4:
        local["temb"] = mine(call["temb"])
    where = {name: i for i, name in enumerate(names[:len(args)])}      # positional: by index
    changes = {where.get(name, name): value for name, value in local.items()}
    later = {key: value for key, value in changes.items() if key not in (where.get(carried), carried)}
    return Shard(*sequence_shard.override(args, kwargs, changes), image=chunk_sizes(video.shape[1], degree),
                 later=later)


def enable_wan_sequence_parallel(denoiser: torch.nn.Module, ulysses_degree: int, make_mesh) -> None:
    """Shard the video tokens of every Wan transformer in ``denoiser`` (Wan 2.2: both experts; VACE's) over the
    mesh ``make_mesh()`` builds once everything is validated (ConfigError where it cannot: a self-attention
    processor other than diffusers' WanAttnProcessor, fused projections, heads ``ulysses_degree`` does not divide)."""
    sequence_shard.install(denoiser, make_mesh, lambda: _plan(denoiser, ulysses_degree))


def _plan(denoiser: torch.nn.Module, degree: int) -> list[Sharded]:
    targets = [(name or type(denoiser).__name__, m) for name, m in denoiser.named_modules()
               if type(m).__name__ in _TRANSFORMERS and len(getattr(m, "blocks", ())) > 0]
    if not targets:
        raise ConfigError(f"Wan sequence parallel: {type(denoiser).__name__} has no {' or '.join(_TRANSFORMERS)} "
                          "blocks to shard")
    return [sharded for name, transformer in targets for sharded in _sharded(name, transformer, degree)]


def _sharded(name: str, transformer: torch.nn.Module, degree: int) -> list[Sharded]:
    """The Wan blocks (gathered after the last), or VACE's control branch and its Wan blocks (gathered at the output
    norm, after the last hint)."""
    blocks, vace = list(transformer.blocks), list(getattr(transformer, "vace_blocks", ()))
    for attn, where in _self_attentions(name, blocks, vace):
        if type(attn.processor).__name__ != _PROCESSOR or attn.is_cross_attention:
            raise ConfigError(f"Wan sequence parallel: {where} uses {type(attn.processor).__name__}; only the "
                              f"self-attention of diffusers' {_PROCESSOR} is sharded")
        if getattr(attn, "fused_projections", False):
            raise ConfigError(f"Wan sequence parallel: {where} has fused q/k/v projections, which it does not implement")
        check_ulysses_heads(attn.heads, degree)

    def processor(mesh: SequenceMesh, state: ShardState, attn) -> WanUlyssesAttnProcessor:
        return WanUlyssesAttnProcessor(mesh, state, attn.processor)

    if not vace:
        return [Sharded(name, blocks, blocks[-1], [block.attn1 for block in blocks], processor, split_video)]
    return [Sharded(f"{name}.vace_blocks", vace, None, [block.attn1 for block in vace], processor, split_control),
            Sharded(name, blocks, transformer.norm_out, [block.attn1 for block in blocks], processor, split_video)]


def _self_attentions(name: str, blocks: list, vace: list):
    """(attn1, its name in errors) of every Wan block and every VACE block."""
    for label, group in (("blocks", blocks), ("vace_blocks", vace)):
        for i, block in enumerate(group):
            yield block.attn1, f"{name}.{label}.{i}.attn1"
