"""Sequence parallelism (Ulysses, ring, Ulysses × ring) for Z-Image's single-stream DiT
(``ZImageTransformer2DModel``), over the shared distributed.usp.SequenceMesh.

Each main layer attends over one row's unified sequence ``[image tokens ‖ caption tokens]`` (each part padded
to a multiple of 32 with a learned, attended pad token), rows padded to the longest of the forward with a key
mask (None when every row has one length). Modulation (per row), norms and the MLP are token-local, so the
unified sequence is cut across the P ranks of the sp group (``torch.tensor_split``: chunks may be uneven)::

    layers[0] pre-hook          unified (B, L, D) → my chunk; its rotary rows (B, L, d/2) and mask (B, L) → my
                                chunk (for every later layer too: they are called positionally, so by position);
                                the key mask over every rank's tokens is the layer's mask itself (chunks in order)
    attention (processor)       q, k, v of my tokens (RMS-normed per head, my rotary rows) → mesh.attention
                                (Ulysses inside, ring across) over every rank's tokens, with the key mask → to_out
    final layer forward hook    my tokens' patch outputs → all_gather → (B, L, p·p·C): unpatchify sees them all

Padded query tokens (past a row's length) compute what they compute unsharded: only keys are masked, as in
diffusers. The noise and context refiners (image tokens alone, caption tokens alone) run before the first
layer, whole on every rank. A call with fewer unified tokens than sp ranks runs unsharded through the model's
own processor. The hooks, the shard state and validate-then-install are distributed/sequence_shard.py's.
"""

from __future__ import annotations

import torch

from stage_runtime.distributed import sequence_shard
from stage_runtime.distributed.sequence_shard import Shard, ShardState, Sharded, check_ulysses_heads
from stage_runtime.distributed.ulysses_joint import chunk_sizes
from stage_runtime.distributed.usp import SequenceMesh
from stage_runtime.errors import ConfigError

_TRANSFORMER = "ZImageTransformer2DModel"
_PROCESSOR = "ZSingleStreamAttnProcessor"
# ZImageTransformerBlock.forward, as the transformer calls it (positionally)
_BLOCK_ARGS = ("x", "attn_mask", "freqs_cis", "adaln_input", "noise_mask", "adaln_noisy", "adaln_clean")
_PER_TOKEN = ("attn_mask", "freqs_cis", "noise_mask")        # cut with the tokens; the stream itself flows on


def rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Z-Image's rotary turn (its processor's ``apply_rotary_emb``): pairs of channels as complex numbers."""
    turned = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)) * freqs.unsqueeze(2)
    return torch.view_as_real(turned).flatten(3).type_as(x)


class ZImageUlyssesAttnProcessor:
    """The single-stream attention of one Z-Image layer from my chunk of the unified sequence; unsharded calls
    (and the refiners, whose attentions keep the model's processor) go to the model's own processor."""

    def __init__(self, mesh: SequenceMesh, state: ShardState, original):
        self.mesh, self.state, self.original = mesh, state, original

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, freqs_cis: torch.Tensor | None = None) -> torch.Tensor:
        shard = self.state.shard
        if shard is None:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, freqs_cis)
        query, key, value = (proj(hidden_states).unflatten(-1, (attn.heads, -1))
                             for proj in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if freqs_cis is not None:                             # my rows of the table (the split rule's)
            query, key = rotate(query, freqs_cis), rotate(key, freqs_cis)
        dtype = query.dtype
        out = self.mesh.attention(query, key.to(dtype), value, shard.image, shard.key_mask)   # (B, S_s, H, D)
        out = attn.to_out[0](out.flatten(2, 3).to(dtype))
        return attn.to_out[1](out) if len(attn.to_out) > 1 else out


def split_zimage(mesh: SequenceMesh, args: tuple, kwargs: dict) -> Shard | None:
    """The split rule of a layer's call: my chunk of the unified tokens and of every per-token argument (for
    every later layer too), the key mask over every rank's tokens. None (unsharded) when a row has fewer
    tokens than sp ranks."""
    call = {**dict(zip(_BLOCK_ARGS, args)), **kwargs}
    unified = call["x"]
    degree, rank = mesh.sp_size, mesh.sp_rank
    if unified.shape[1] < degree:
        return None
    local = {"x": torch.tensor_split(unified, degree, dim=1)[rank]}
    for name in _PER_TOKEN:
        if call.get(name) is not None:
            local[name] = torch.tensor_split(call[name], degree, dim=1)[rank]
    where = {name: i for i, name in enumerate(_BLOCK_ARGS[:len(args)])}          # positional: by index
    changes = {where.get(name, name): value for name, value in local.items()}
    mask = call.get("attn_mask")
    return Shard(*sequence_shard.override(args, kwargs, changes), image=chunk_sizes(unified.shape[1], degree),
                 later={key: value for key, value in changes.items() if key not in (0, "x")},
                 key_mask=None if mask is None else mask.bool())


def enable_zimage_sequence_parallel(transformer: torch.nn.Module, ulysses_degree: int, make_mesh) -> None:
    """Shard the unified sequence of every main layer of a ZImageTransformer2DModel over the mesh ``make_mesh()``
    builds once everything is validated (ConfigError where it cannot: another transformer, a processor other
    than diffusers' ZSingleStreamAttnProcessor, several patch sizes, heads ``ulysses_degree`` does not divide)."""
    sequence_shard.install(transformer, make_mesh, lambda: [_plan(transformer, ulysses_degree)])


def _plan(transformer: torch.nn.Module, degree: int) -> Sharded:
    name = type(transformer).__name__
    layers = list(getattr(transformer, "layers", ()))
    if name != _TRANSFORMER or not layers:
        raise ConfigError(f"Z-Image sequence parallel: {name} is not a {_TRANSFORMER} with layers")
    finals = list(transformer.all_final_layer.values())
    if len(finals) != 1:
        raise ConfigError(f"Z-Image sequence parallel: {name} has {len(finals)} patch sizes "
                          f"({', '.join(transformer.all_final_layer)}); one is sharded")
    for i, layer in enumerate(layers):
        attn, where = layer.attention, f"{name}.layers.{i}.attention"
        if type(attn.processor).__name__ != _PROCESSOR:
            raise ConfigError(f"Z-Image sequence parallel: {where} uses {type(attn.processor).__name__}; only "
                              f"diffusers' {_PROCESSOR} is sharded")
        check_ulysses_heads(attn.heads, degree)
    return Sharded(name, layers, finals[0], [layer.attention for layer in layers],
                   lambda mesh, state, attn: ZImageUlyssesAttnProcessor(mesh, state, attn.processor),
                   split_zimage)
