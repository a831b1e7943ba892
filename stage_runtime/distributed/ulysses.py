"""Ulysses sequence parallelism for the transformer blocks of SD's UNet and of DiT, over torch.distributed.

Per transformer (each ``Transformer2DModel`` inside a UNet, or a ``DiTTransformer2DModel``)::

    block[0] pre-hook          hidden_states (B, S, C) → my contiguous token chunk (B, S/P, C)
    every block                norms, feed-forward, cross-attention: token-local, run on S/P tokens;
                               self-attention: UlyssesAttnProcessor (two all_to_all, below)
    block[-1] forward hook     (B, S/P, C) → all_gather over tokens → (B, S, C)

A transformer whose sequence length S is not divisible by P (or that gets an attention mask) runs
unsharded for that call: every rank sees the same shapes, so the decision is the same on all ranks.
The hooks, the shard state and validate-then-install are distributed/sequence_shard.py's; this module
brings the processor and the split rule (``split_tokens``).

Self-attention (``attn.is_cross_attention`` False) sees the whole sequence by trading tokens for
heads. With P = 2 ranks, H heads, tokens t0 (rank 0's chunk) and t1 (rank 1's)::

    before (rank r holds)        all_to_all #1                after (rank r holds)
    q,k,v[t_r, heads 0..H)   ── head group j → rank j ──▶   q,k,v[t0 ‖ t1, heads group r (H/P)]
                                                            SDPA over ALL tokens, my H/P heads
    out[t0 ‖ t1, group r]    ── token chunk j → rank j ──▶  out[t_r, heads 0..H)   → to_out

One all_to_all carries q, k and v stacked; send slice j of dim 0 = head group j of my tokens, receive
slice j = my head group of rank j's tokens (so the tokens arrive in global order). Cross-attention
with replicated encoder states needs no communication (local queries, all keys).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.attention_processor import Attention

from stage_runtime.distributed import sequence_shard
from stage_runtime.distributed.sequence_shard import Shard, ShardState, Sharded, check_ulysses_heads
from stage_runtime.distributed.usp import SequenceMesh
from stage_runtime.errors import ConfigError

_TRANSFORMERS = ("Transformer2DModel", "DiTTransformer2DModel")


class UlyssesAttnProcessor:
    """Self-attention over the full sequence from a token shard (see the module docstring); with a ring
    in the mesh, Ulysses × ring (distributed.usp)."""

    def __init__(self, mesh: SequenceMesh, state: ShardState):
        self.mesh, self.state = mesh, state

    def __call__(self, attn: Attention, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 temb: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        if hidden_states.ndim != 3:
            raise RuntimeError(f"Ulysses attention expects (batch, tokens, channels), got {tuple(hidden_states.shape)}")
        shard = self.state.shard if encoder_hidden_states is None else None
        if shard is not None and attention_mask is not None:
            raise RuntimeError("Ulysses attention got an attention mask for a sharded sequence")
        batch, tokens, _ = hidden_states.shape
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, context.shape[1], batch)
            attention_mask = attention_mask.view(batch, attn.heads, -1, attention_mask.shape[-1])
        query, key, value = attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)
        head_dim = key.shape[-1] // attn.heads
        if shard is not None:   # (B, S/P, H·D) ×3 → attention of my tokens over all S tokens (usp: Ulysses / ring)
            q, k, v = (t.view(batch, tokens, attn.heads, head_dim) for t in (query, key, value))
            out = self.mesh.attention(q, k, v, shard.image).reshape(batch, tokens, -1)
        else:
            query, key, value = (t.view(batch, -1, attn.heads, head_dim).transpose(1, 2) for t in (query, key, value))
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=0.0,
                                                 is_causal=False)                    # (B, H, S_q, D)
            out = out.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim)
        out = attn.to_out[0](out.to(query.dtype))
        return attn.to_out[1](out)


def _check_block(block: torch.nn.Module, where: str, degree: int) -> list[Attention]:
    """The block's self-attentions, after rejecting what the sharded path does not implement."""
    if not isinstance(block, BasicTransformerBlock):
        raise ConfigError(f"Ulysses: {where} is a {type(block).__name__}, only BasicTransformerBlock is supported")
    if block.pos_embed is not None or hasattr(block, "fuser"):
        raise ConfigError(f"Ulysses: {where} uses per-position embeddings or GLIGEN fusion (token-index dependent)")
    selfs = []
    for name in ("attn1", "attn2"):
        attn = getattr(block, name, None)
        if attn is None or attn.is_cross_attention:
            continue           # cross-attention: local queries against replicated encoder states
        unsupported = [
            feature for feature, present in (
                ("group_norm", attn.group_norm is not None), ("spatial_norm", attn.spatial_norm is not None),
                ("norm_q/norm_k", attn.norm_q is not None or attn.norm_k is not None),
                ("norm_cross", attn.norm_cross is not None),
                ("residual_connection", attn.residual_connection),
                (f"rescale_output_factor={attn.rescale_output_factor}", attn.rescale_output_factor != 1.0),
                ("added_kv_proj", getattr(attn, "add_k_proj", None) is not None),
                ("scale_qk=False", not attn.scale_qk))
            if present]
        if unsupported:
            raise ConfigError(f"Ulysses: {where}.{name} uses {', '.join(unsupported)}, "
                              "which the Ulysses attention processor does not implement")
        check_ulysses_heads(attn.heads, degree)
        selfs.append(attn)
    return selfs


def split_tokens(mesh: SequenceMesh, args: tuple, kwargs: dict) -> Shard | None:
    """The split rule: hidden states (B, S, C) → my contiguous S/P tokens; None (unsharded) when S is not
    divisible by P or the call has an attention mask or encoder hidden states given positionally."""
    hidden, degree = (args[0] if args else kwargs["hidden_states"]), mesh.sp_size
    if hidden.ndim != 3 or hidden.shape[1] % degree or kwargs.get("attention_mask") is not None \
            or (len(args) > 1 and args[1] is not None):
        return None
    local = hidden.chunk(degree, dim=1)[mesh.sp_rank]
    args, kwargs = ((local, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": local})
    return Shard(args, kwargs, image=[local.shape[1]] * degree)


def enable_ulysses(denoiser: torch.nn.Module, group, degree: int) -> None:
    """Shard the token sequence of every supported transformer in ``denoiser`` across ``group``.

    Raises ConfigError when the denoiser has no supported transformer, when a block uses a feature the
    processor does not implement, or when ``degree`` does not divide a self-attention's heads.
    """
    if degree > 1:
        enable_sequence_parallel(denoiser, degree, lambda: SequenceMesh.ulysses(group, degree))


def enable_sequence_parallel(denoiser: torch.nn.Module, ulysses_degree: int, make_mesh) -> None:
    """Shard as :func:`enable_ulysses` does, over the mesh ``make_mesh()`` builds once everything is
    validated (Ulysses × ring; ``ulysses_degree`` is what the heads must be divisible by)."""
    sequence_shard.install(denoiser, make_mesh, lambda: _plan(denoiser, ulysses_degree))


def _plan(denoiser: torch.nn.Module, degree: int) -> list[Sharded]:
    targets = [(name or type(denoiser).__name__, m) for name, m in denoiser.named_modules()
               if type(m).__name__ in _TRANSFORMERS and len(getattr(m, "transformer_blocks", ())) > 0]
    if not targets:
        raise ConfigError(f"Ulysses: {type(denoiser).__name__} has no Transformer2DModel/DiTTransformer2DModel "
                          "blocks to shard")
    return [Sharded(name, list(m.transformer_blocks), m.transformer_blocks[-1],
                    [attn for i, block in enumerate(m.transformer_blocks)
                     for attn in _check_block(block, f"{name}.transformer_blocks.{i}", degree)],
                    lambda mesh, state, _attn: UlyssesAttnProcessor(mesh, state), split_tokens)
            for name, m in targets]
