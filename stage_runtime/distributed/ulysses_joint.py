"""Ulysses sequence parallelism over the JOINT text+image sequence of MMDiT transformers (SD3, FLUX.1).

MMDiT blocks keep two token streams, image and text, and every attention runs over both at once.
Both streams are sharded across the P ranks of the sequence-parallel group; everything but attention
is token-local, so it runs on the shard::

    transformer_blocks[0] pre-hook   image (B, S_i, C) → my chunk (B, S_i/P, C); text (B, S_t, C) → (B, S_t/P, C);
                                     FLUX: the rotary table (S_t + S_i, D) → the rows of my text and image tokens
    every attention                  JointUlyssesProcessor: local q, k, v of [my image ‖ my text] tokens (SD3 order;
                                     FLUX: [text ‖ image], rotary applied locally) → all_to_all: ALL tokens, H/P heads
                                     → SDPA → all_to_all back: my tokens, all heads → the block's own projections
    proj_out forward hook            my image tokens (B, S_i/P, c) → all_gather → (B, S_i, c)

Chunks may be uneven (SD3's text is 77 + 256 = 333 tokens): rank r gets ``torch.tensor_split``'s r-th chunk of
each stream, and the all_to_all carries per-rank token counts every rank derives from the same shapes.
Keys arrive grouped by rank rather than in global order; attention without a mask does not depend on key
order, so each query sees exactly the keys (and rotary positions) it sees unsharded. FLUX's single-stream
blocks concatenate [text ‖ image] themselves; the local shards concatenate the same way. A stream shorter
than P tokens runs unsharded (the same decision on every rank). The head count must be divisible by P.
The hooks, the shard state and validate-then-install are distributed/sequence_shard.py's; this module brings
the processor and the split rule (``split_streams``, which Qwen-Image's rule extends).
"""

from __future__ import annotations

import math

import torch

from stage_runtime.distributed import sequence_shard
from stage_runtime.distributed.sequence_shard import Shard, ShardState, Sharded, check_ulysses_heads
from stage_runtime.distributed.usp import SequenceMesh
from stage_runtime.errors import ConfigError

_DEFAULT_PROCESSORS = {"JointAttnProcessor2_0": "sd3", "FluxAttnProcessor": "flux"}


def chunk_sizes(length: int, parts: int) -> list[int]:
    """Token counts of ``torch.tensor_split(range(length), parts)``: the first ``length % parts`` get one more."""
    return [length // parts + (1 if r < length % parts else 0) for r in range(parts)]


def joint_attention_heads(denoiser: torch.nn.Module) -> int:
    """The head count every joint attention of the transformer is divisible by (gcd over layers)."""
    heads = [m.heads for m in denoiser.modules() if hasattr(m, "processor") and hasattr(m, "heads")]
    return math.gcd(*heads) if heads else 1


def joint_projections(attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None):
    """(image q, k, v), (text q, k, v or None without encoder states): (B, S, H, D) each, q and k normed as
    the model does."""
    head_dim = attn.to_q.out_features // attn.heads

    def project(x: torch.Tensor, projections, norm_q, norm_k) -> list[torch.Tensor]:
        q, k, v = (p(x).unflatten(-1, (attn.heads, head_dim)) for p in projections)
        return [q, k, v] if norm_q is None else [norm_q(q), norm_k(k), v]

    image = project(hidden_states, (attn.to_q, attn.to_k, attn.to_v), attn.norm_q, attn.norm_k)
    if encoder_hidden_states is None:
        return image, None
    return image, project(encoder_hidden_states, (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj),
                          attn.norm_added_q, attn.norm_added_k)


class JointUlyssesProcessor:
    """The attention of one SD3 ``Attention`` / FLUX ``FluxAttention``; unsharded calls go to the original."""

    def __init__(self, mesh: SequenceMesh, state: ShardState, original, family: str):
        self.mesh, self.state, self.original, self.family = mesh, state, original, family
        self.rank = mesh.sp_rank

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None,
                 *args, **kwargs):
        if self.state.shard is None:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask,
                                 *(() if image_rotary_emb is None else (image_rotary_emb,)), *args, **kwargs)
        if attention_mask is not None:
            raise RuntimeError("joint Ulysses attention got an attention mask for a sharded sequence")
        (query, key, value), text = joint_projections(attn, hidden_states, encoder_hidden_states)
        joint = text is not None
        if joint:
            first, second = (text, (query, key, value)) if self.family == "flux" else ((query, key, value), text)
            query, key, value = (torch.cat([a, b], dim=1) for a, b in zip(first, second, strict=True))
        if image_rotary_emb is not None:
            from diffusers.models.embeddings import apply_rotary_emb

            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        counts = self._counts(joint, hidden_states.shape[1])
        out = self.mesh.attention(query, key, value, counts).flatten(2, 3).to(query.dtype)
        if not joint:
            if self.family == "flux":                                # single-stream block: pre_only
                return out
            return attn.to_out[1](attn.to_out[0](out))
        text_len = encoder_hidden_states.shape[1]
        if self.family == "flux":
            context, image = out[:, :text_len], out[:, text_len:]
        else:
            image, context = out[:, :-text_len], out[:, -text_len:]
        image = attn.to_out[1](attn.to_out[0](image.contiguous()))
        if self.family == "flux" or not attn.context_pre_only:
            context = attn.to_add_out(context.contiguous())
        return image, context

    def _counts(self, joint: bool, local_tokens: int) -> list[int]:
        """Every rank's token count for this attention: image (+ text when joint). FLUX's single-stream
        blocks get [text ‖ image] as one stream; SD3's second attention (attn2) sees image tokens only."""
        image, text = self.state.shard.image, self.state.shard.text
        counts = [i + t for i, t in zip(image, text, strict=True)] if joint or self.family == "flux" else list(image)
        if counts[self.rank] != local_tokens + (text[self.rank] if joint else 0):
            raise RuntimeError(f"joint Ulysses: {local_tokens} local tokens do not match the shard plan {counts}")
        return counts


def _check_attention(name: str, attn, degree: int) -> str:
    kind = _DEFAULT_PROCESSORS.get(type(attn.processor).__name__)
    if kind is None:
        raise ConfigError(f"Ulysses: {name} uses {type(attn.processor).__name__}; the joint Ulysses processor "
                          f"replaces only {', '.join(_DEFAULT_PROCESSORS)} (fused or IP-adapter attention is not sharded)")
    if getattr(attn, "fused_projections", False):
        raise ConfigError(f"Ulysses: {name} has fused q/k/v projections, which joint Ulysses does not implement")
    check_ulysses_heads(attn.heads, degree)
    return kind


def _shard_rotary(rotary, text_len: int, text_counts: list[int], image_counts: list[int], rank: int):
    """FLUX's (cos, sin) rows over [text ‖ image] → the rows of my text chunk then my image chunk."""
    t0, i0 = sum(text_counts[:rank]), text_len + sum(image_counts[:rank])
    return tuple(torch.cat([f[t0:t0 + text_counts[rank]], f[i0:i0 + image_counts[rank]]]) for f in rotary)


def split_streams(mesh: SequenceMesh, args: tuple, kwargs: dict) -> Shard | None:
    """Split an MMDiT block's keyword call: each stream (image ``hidden_states``, text ``encoder_hidden_states``)
    → my ``torch.tensor_split`` chunk; None (unsharded) when a stream has fewer tokens than ranks."""
    if args:
        raise RuntimeError("joint Ulysses expects the MMDiT block to be called with keyword arguments")
    image, text, degree, rank = kwargs["hidden_states"], kwargs["encoder_hidden_states"], mesh.sp_size, mesh.sp_rank
    if min(image.shape[1], text.shape[1]) < degree:
        return None
    local = {**kwargs, "hidden_states": torch.tensor_split(image, degree, dim=1)[rank],
             "encoder_hidden_states": torch.tensor_split(text, degree, dim=1)[rank]}
    return Shard(args, local, image=chunk_sizes(image.shape[1], degree), text=chunk_sizes(text.shape[1], degree))


def split_joint(mesh: SequenceMesh, args: tuple, kwargs: dict) -> Shard | None:
    """The split rule: both streams; FLUX.1 and FLUX.2 (models/families/flux2.py): my rows of the rotary table,
    for this block and every later one."""
    shard = split_streams(mesh, args, kwargs)
    if shard is not None and kwargs.get("image_rotary_emb") is not None:
        rotary = _shard_rotary(kwargs["image_rotary_emb"], sum(shard.text), shard.text, shard.image, mesh.sp_rank)
        shard.kwargs["image_rotary_emb"] = shard.later["image_rotary_emb"] = rotary
    return shard


def enable_joint_ulysses(transformer: torch.nn.Module, group, degree: int) -> None:
    """Shard the joint sequence of an SD3Transformer2DModel / FluxTransformer2DModel across ``group``.

    ConfigError when the heads are not divisible by ``degree``, when an attention uses a processor this
    does not implement, or when the group has the wrong size. Validates everything before installing anything.
    """
    if degree > 1:
        enable_joint_sequence_parallel(transformer, degree, lambda: SequenceMesh.ulysses(group, degree))


def enable_joint_sequence_parallel(transformer: torch.nn.Module, ulysses_degree: int, make_mesh) -> None:
    """Shard the joint sequence across the mesh ``make_mesh()`` builds once everything is validated
    (Ulysses × ring; ``ulysses_degree`` is what the heads must be divisible by)."""
    sequence_shard.install(transformer, make_mesh, lambda: [_plan(transformer, ulysses_degree)])


def _plan(transformer: torch.nn.Module, degree: int) -> Sharded:
    name = type(transformer).__name__
    blocks = [*getattr(transformer, "transformer_blocks", ()), *getattr(transformer, "single_transformer_blocks", ())]
    attentions = [(f"{name}.{n}", m) for n, m in transformer.named_modules()
                  if hasattr(m, "processor") and hasattr(m, "heads")]
    if not blocks or not attentions or not hasattr(transformer, "proj_out"):
        raise ConfigError(f"Ulysses: {name} has no MMDiT blocks to shard")
    kinds = {_check_attention(n, attn, degree) for n, attn in attentions}
    if len(kinds) != 1:
        raise ConfigError(f"Ulysses: {name} mixes attention kinds {sorted(kinds)}")
    family = kinds.pop()
    return Sharded(name, blocks, transformer.proj_out, [attn for _, attn in attentions],
                   lambda mesh, state, attn: JointUlyssesProcessor(mesh, state, attn.processor, family), split_joint)
