"""Sequence parallelism (Ulysses, ring, Ulysses × ring) for HunyuanVideo-1.5's dual-stream video DiT
(``HunyuanVideo15Transformer3DModel``), over the shared distributed.usp.SequenceMesh.

Each block attends over the JOINT sequence ``[video ‖ context]``: the context is the model's reordered
``[valid image, valid ByT5, valid Qwen ‖ padding]`` tokens (1985 a row: 729 + 256 + 1000) with its mask
(T2V: the image tokens masked out). diffusers' ``HunyuanVideo15AttnProcessor2_0`` masks keys AND queries
(``mask_1 & mask_2``): a padded context token attends to nothing (SDPA gives it zeros) and no token attends
to it. Modulation (per row), norms and MLPs are token-local, so both streams are cut across the P ranks of
the sp group (``torch.tensor_split``: chunks may be uneven, 1985 never splits evenly)::

    transformer_blocks[0] pre-hook   video (B, S, C) → my chunk; context (B, T, C) and its mask (B, T) → my
                                     chunk; the rotary tables (S, D) → my rows (the mask and the rows for
                                     every later block: blocks are called positionally, so by position)
    joint attention (processor)      q, k, v of [my video ‖ my context] (q/k RMS-normed per head, rotary on
                                     the video) → mesh.attention (Ulysses inside, ring across) over every
                                     rank's tokens with the key mask [video: all ‖ context: its mask] of every
                                     rank, in sp-rank order → my padded context queries zeroed (as SDPA's
                                     fully masked rows) → to_out (video), to_add_out (context)
    proj_out forward hook            my video tokens → all_gather → (B, S, c): the unpatchify sees every token

So every token's state is the unsharded one, padded context tokens included. The token refiner (the Qwen
text's own self-attention) runs before the first block, whole on every rank. A call with fewer video or
context tokens than sp ranks runs unsharded on every rank, through the model's own processor. The hooks,
the shard state and validate-then-install are distributed/sequence_shard.py's.
"""

from __future__ import annotations

import torch

from stage_runtime.distributed import sequence_shard
from stage_runtime.distributed.sequence_shard import Shard, ShardState, Sharded, check_ulysses_heads
from stage_runtime.distributed.ulysses_joint import chunk_sizes, joint_projections
from stage_runtime.distributed.usp import SequenceMesh
from stage_runtime.errors import ConfigError

_TRANSFORMER = "HunyuanVideo15Transformer3DModel"
_PROCESSOR = "HunyuanVideo15AttnProcessor2_0"
# HunyuanVideo15TransformerBlock.forward, as the transformer calls it (positionally)
_BLOCK_ARGS = ("hidden_states", "encoder_hidden_states", "temb", "attention_mask", "freqs_cis")
_STREAMS = (0, 1, "hidden_states", "encoder_hidden_states")     # flow from block to block: not overridden


class HunyuanVideo15UlyssesAttnProcessor:
    """The joint attention of one HunyuanVideo-1.5 block from my chunk of each stream (see the module
    docstring); unsharded calls go to the model's own processor."""

    def __init__(self, mesh: SequenceMesh, state: ShardState, original):
        self.mesh, self.state, self.original = mesh, state, original

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None):
        shard = self.state.shard
        if shard is None:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        if encoder_hidden_states is None or attention_mask is None or \
                tuple(attention_mask.shape) != tuple(encoder_hidden_states.shape[:2]):
            raise RuntimeError("HunyuanVideo-1.5 sequence parallel: the sharded attention needs the context tokens "
                               "and their mask, of one length")
        from diffusers.models.embeddings import apply_rotary_emb

        video, context = joint_projections(attn, hidden_states, encoder_hidden_states)
        if image_rotary_emb is not None:                      # my rows of the tables (the split rule's)
            video[0], video[1] = (apply_rotary_emb(t, image_rotary_emb, sequence_dim=1) for t in video[:2])
        query, key, value = (torch.cat([v, c], dim=1) for v, c in zip(video, context, strict=True))
        counts = [v + c for v, c in zip(shard.image, shard.text, strict=True)]
        out = self.mesh.attention(query, key, value, counts, shard.key_mask)          # (B, S_s, H, D)
        tokens = hidden_states.shape[1]
        padded = ~attention_mask.bool()[:, :, None, None]    # the query mask: fully masked rows give zeros
        out = torch.cat([out[:, :tokens], out[:, tokens:].masked_fill(padded, 0.0)], dim=1)
        out = out.flatten(2, 3).to(query.dtype)
        video_out = attn.to_out[1](attn.to_out[0](out[:, :tokens].contiguous()))
        return video_out, attn.to_add_out(out[:, tokens:].contiguous())


def split_hunyuan(mesh: SequenceMesh, args: tuple, kwargs: dict) -> Shard | None:
    """The split rule of a block's call (positional, as the transformer makes it, or keywords): my chunk of the
    video and context tokens, my chunk of the context mask and my rows of the rotary tables (these two for
    every later block too), and the key mask over every rank's [video ‖ context] tokens. None (unsharded)
    when a stream has fewer tokens than sp ranks."""
    call = {**dict(zip(_BLOCK_ARGS, args)), **kwargs}
    video, context, mask = call["hidden_states"], call["encoder_hidden_states"], call.get("attention_mask")
    if mask is None:
        raise RuntimeError("HunyuanVideo-1.5 sequence parallel: a block was called without its context mask")
    degree, rank = mesh.sp_size, mesh.sp_rank
    if min(video.shape[1], context.shape[1]) < degree:
        return None

    def mine(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return torch.tensor_split(t, degree, dim=dim)[rank]

    masks = torch.tensor_split(mask.bool(), degree, dim=1)
    video_counts = chunk_sizes(video.shape[1], degree)
    local = {"hidden_states": mine(video), "encoder_hidden_states": mine(context), "attention_mask": masks[rank]}
    if call.get("freqs_cis") is not None:
        local["freqs_cis"] = tuple(mine(table, dim=0) for table in call["freqs_cis"])
    where = {name: i for i, name in enumerate(_BLOCK_ARGS[:len(args)])}      # positional: by index
    changes = {where.get(name, name): value for name, value in local.items()}
    key_mask = torch.cat([part for m, n in zip(masks, video_counts, strict=True)
                          for part in (m.new_ones((m.shape[0], n)), m)], dim=1)
    return Shard(*sequence_shard.override(args, kwargs, changes), image=video_counts,
                 text=chunk_sizes(context.shape[1], degree),
                 later={key: value for key, value in changes.items() if key not in _STREAMS}, key_mask=key_mask)


def enable_hunyuan_video15_sequence_parallel(transformer: torch.nn.Module, ulysses_degree: int, make_mesh) -> None:
    """Shard both token streams of every block of a HunyuanVideo15Transformer3DModel over the mesh
    ``make_mesh()`` builds once everything is validated (ConfigError where it cannot: another transformer, a
    processor other than diffusers' HunyuanVideo15AttnProcessor2_0, fused projections, heads
    ``ulysses_degree`` does not divide)."""
    sequence_shard.install(transformer, make_mesh, lambda: [_plan(transformer, ulysses_degree)])


def _plan(transformer: torch.nn.Module, degree: int) -> Sharded:
    name = type(transformer).__name__
    blocks = list(getattr(transformer, "transformer_blocks", ()))
    if name != _TRANSFORMER or not blocks:
        raise ConfigError(f"HunyuanVideo-1.5 sequence parallel: {name} is not a {_TRANSFORMER} with transformer_blocks")
    for i, block in enumerate(blocks):
        attn, where = block.attn, f"{name}.transformer_blocks.{i}.attn"
        if type(attn.processor).__name__ != _PROCESSOR:
            raise ConfigError(f"HunyuanVideo-1.5 sequence parallel: {where} uses {type(attn.processor).__name__}; "
                              f"only diffusers' {_PROCESSOR} is sharded")
        if getattr(attn, "fused_projections", False):
            raise ConfigError(f"HunyuanVideo-1.5 sequence parallel: {where} has fused q/k/v projections, which it "
                              "does not implement")
        check_ulysses_heads(attn.heads, degree)
    return Sharded(name, blocks, transformer.proj_out, [block.attn for block in blocks],
                   lambda mesh, state, attn: HunyuanVideo15UlyssesAttnProcessor(mesh, state, attn.processor),
                   split_hunyuan)
