"""Ulysses / ring sequence parallelism over FLUX.2's joint text+image sequence (Flux2Transformer2DModel: FLUX.2
[dev] and [klein]).

Like FLUX.1 (distributed/ulysses_joint.py, whose split rule this reuses), both token streams are cut across the P
ranks of the sequence-parallel group and every attention runs over all tokens; what differs is FLUX.2's attention
modules and how its transformer joins and drops the text::

    transformer_blocks[0] pre-hook   image (B, S_i, C) → my chunk; text (B, S_t, C) → my chunk; the rotary table
                                     over [text ‖ image] → the rows of my text then my image tokens (every block)
    double-stream attention          Flux2UlyssesProcessor: q/k/v of [my text ‖ my image], RMS-normed per head,
    (Flux2Attention)                 rotary → mesh attention (all tokens, H/P heads) → to_add_out / to_out
    the transformer                  joins the streams itself: [my text ‖ my image] is one rank's single-stream input
    single-stream attention          Flux2UlyssesSingleProcessor: the fused to_qkv_mlp_proj on my tokens, the q/k/v
    (Flux2ParallelSelfAttention)     part through the mesh, the MLP part local, to_out over [attention ‖ MLP]
    last single block forward hook   the transformer drops the first S_t (its whole text length) tokens: my t_r text
                                     tokens are padded to S_t so what it keeps is exactly my image tokens
    proj_out forward hook            my image tokens → all_gather → (B, S_i, c) on every rank

Chunks may be uneven; a stream with fewer tokens than ranks runs unsharded (the same decision on every rank).
The heads must divide by the Ulysses degree. Only diffusers' default processors are replaced (the KV-cache
processors of Flux2KleinKV are refused); a processor replaced after install makes the next call raise.
"""

from __future__ import annotations

import torch
from diffusers.models.embeddings import apply_rotary_emb

from stage_runtime.distributed import sequence_shard
from stage_runtime.distributed.sequence_shard import ShardState, Sharded, check_ulysses_heads
from stage_runtime.distributed.ulysses_joint import split_joint
from stage_runtime.distributed.usp import SequenceMesh
from stage_runtime.errors import ConfigError

_DEFAULT_PROCESSORS = ("Flux2AttnProcessor", "Flux2ParallelSelfAttnProcessor")


def _heads(attn, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.unflatten(-1, (-1, attn.head_dim))


class _Processor:
    """Shared by both kinds: the original processor for unsharded calls, the mesh and the shard plan otherwise."""

    def __init__(self, mesh: SequenceMesh, state: ShardState, original):
        self.mesh, self.state, self.original = mesh, state, original

    def attend(self, query, key, value, rotary, local_tokens: int) -> torch.Tensor:
        """Rotary on my tokens, attention over every rank's → (B, local, H · D)."""
        if rotary is not None:
            query = apply_rotary_emb(query, rotary, sequence_dim=1)
            key = apply_rotary_emb(key, rotary, sequence_dim=1)
        shard = self.state.shard
        counts = [i + t for i, t in zip(shard.image, shard.text, strict=True)]
        if counts[self.mesh.sp_rank] != local_tokens:
            raise RuntimeError(f"FLUX.2 Ulysses: {local_tokens} local tokens do not match the shard plan {counts}")
        return self.mesh.attention(query, key, value, counts).flatten(2, 3).to(query.dtype)


class Flux2UlyssesProcessor(_Processor):
    """A double-stream block's Flux2Attention over [text ‖ image]."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None,
                 **kwargs):
        if self.state.shard is None:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb,
                                 **kwargs)
        if attention_mask is not None or encoder_hidden_states is None:
            raise RuntimeError("FLUX.2 Ulysses: a double-stream attention got a mask or no text stream")
        image = [_heads(attn, p(hidden_states)) for p in (attn.to_q, attn.to_k, attn.to_v)]
        text = [_heads(attn, p(encoder_hidden_states)) for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
        image[0], image[1] = attn.norm_q(image[0]), attn.norm_k(image[1])
        text[0], text[1] = attn.norm_added_q(text[0]), attn.norm_added_k(text[1])
        query, key, value = (torch.cat([t, i], dim=1) for t, i in zip(text, image, strict=True))
        out = self.attend(query, key, value, image_rotary_emb, query.shape[1])
        text_len = encoder_hidden_states.shape[1]
        context, image_out = out[:, :text_len], out[:, text_len:]
        return attn.to_out[1](attn.to_out[0](image_out.contiguous())), attn.to_add_out(context.contiguous())


class Flux2UlyssesSingleProcessor(_Processor):
    """A single-stream block's Flux2ParallelSelfAttention over the joint [text ‖ image] tokens."""

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None, **kwargs):
        if self.state.shard is None:
            return self.original(attn, hidden_states, attention_mask, image_rotary_emb, **kwargs)
        if attention_mask is not None:
            raise RuntimeError("FLUX.2 Ulysses: a single-stream attention got an attention mask")
        projected = attn.to_qkv_mlp_proj(hidden_states)
        qkv, mlp = projected.split([3 * attn.inner_dim, projected.shape[-1] - 3 * attn.inner_dim], dim=-1)
        query, key, value = (_heads(attn, t) for t in qkv.chunk(3, dim=-1))
        out = self.attend(attn.norm_q(query), attn.norm_k(key), value, image_rotary_emb, hidden_states.shape[1])
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))


def _check_attention(name: str, attn, degree: int) -> None:
    kind = type(attn.processor).__name__
    if kind not in _DEFAULT_PROCESSORS:
        raise ConfigError(f"Ulysses: {name} uses {kind}; FLUX.2 sequence parallelism replaces only "
                          f"{', '.join(_DEFAULT_PROCESSORS)} (the KV-cache processors are not sharded)")
    if getattr(attn, "fused_projections", False):
        raise ConfigError(f"Ulysses: {name} has fused q/k/v projections, which FLUX.2 Ulysses does not implement")
    check_ulysses_heads(attn.heads, degree)


def enable_flux2_sequence_parallel(transformer: torch.nn.Module, ulysses_degree: int, make_mesh) -> None:
    """Shard a Flux2Transformer2DModel's joint sequence across the mesh ``make_mesh()`` builds once everything is
    validated (ConfigError: heads not divisible by ``ulysses_degree``, another processor, a wrong group)."""
    sequence_shard.install(transformer, make_mesh, lambda: [_plan(transformer, ulysses_degree)])


def _plan(transformer: torch.nn.Module, degree: int) -> Sharded:
    name = type(transformer).__name__
    double, single = (list(getattr(transformer, n, ())) for n in ("transformer_blocks", "single_transformer_blocks"))
    if not double or not single or not hasattr(transformer, "proj_out"):
        raise ConfigError(f"Ulysses: {name} has no FLUX.2 double- and single-stream blocks to shard")
    attentions = [(f"{name}.{n}", m) for n, m in transformer.named_modules() if n.endswith(".attn")]
    for attn_name, attn in attentions:
        _check_attention(attn_name, attn, degree)
    plan = _Flux2Plan(single[-1])
    return Sharded(name, [*double, *single], transformer.proj_out, [attn for _, attn in attentions], plan.processor,
                   plan.split)


class _Flux2Plan:
    """The split rule (FLUX.1's: both streams, my rotary rows), the processors, and the last single-stream block's
    hook that pads my text tokens to the whole text length (installed with the processors, after validation)."""

    def __init__(self, last_block: torch.nn.Module):
        self.last_block, self.hooked = last_block, False
        self.shard, self.rank = None, 0

    def split(self, mesh: SequenceMesh, args: tuple, kwargs: dict):
        self.shard, self.rank = split_joint(mesh, args, kwargs), mesh.sp_rank
        return self.shard

    def keep_my_image(self, _module, _args, output: torch.Tensor):
        """[my text ‖ my image] → [zeros up to the whole text length ‖ my text ‖ my image]: the transformer's
        ``hidden_states[:, num_txt_tokens:]`` then keeps exactly my image tokens."""
        shard, self.shard = self.shard, None
        if shard is None:
            return None
        missing = sum(shard.text) - shard.text[self.rank]
        return torch.cat([output.new_zeros((output.shape[0], missing, output.shape[2])), output], dim=1)

    def processor(self, mesh: SequenceMesh, state: ShardState, attn) -> _Processor:
        if not self.hooked:
            self.last_block.register_forward_hook(self.keep_my_image)
            self.hooked = True
        single = type(attn.processor).__name__ == "Flux2ParallelSelfAttnProcessor"
        return (Flux2UlyssesSingleProcessor if single else Flux2UlyssesProcessor)(mesh, state, attn.processor)
