"""Sequence parallelism (Ulysses, ring, Ulysses × ring) for Qwen-Image's dual-stream MMDiT
(QwenImageTransformer2DModel), over the shared distributed.usp.SequenceMesh as SD3 and FLUX.1 do.

Each block attends over the JOINT sequence ``[text ‖ image]``. Both streams are cut across the P ranks of
the sp group (``torch.tensor_split``: chunks may be uneven); modulation, norms and MLPs are token-local, so
they run on the chunks::

    transformer_blocks[0] pre-hook   image (B, S, C) → my chunk; text (B, T, C) → my chunk; the rotary
                                     tables (image S rows, text T rows) → my rows, for every block
    joint attention (processor)      q, k, v of [my text ‖ my image] → mesh.attention (Ulysses inside, ring
                                     across) over every rank's tokens → to_out (image), to_add_out (text)
    proj_out forward hook            my image tokens → all_gather → (B, S, c)

Padded prompts come with a key mask over the text (``encoder_hidden_states_mask``): every rank holds the
whole mask, so the split rule builds the mask over every rank's [text ‖ image] tokens (image: always
attended) once per call and the mesh cuts each key block's part. A stream with fewer tokens than ranks
runs the call unsharded on every rank, through the model's own processor.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention

from stage_runtime.distributed import sequence_shard
from stage_runtime.distributed.sequence_shard import Shard, ShardState, Sharded, check_ulysses_heads
from stage_runtime.distributed.ulysses_joint import joint_projections, split_streams
from stage_runtime.distributed.usp import SequenceMesh
from stage_runtime.errors import ConfigError


class QwenUlyssesAttnProcessor:
    """Joint text+image attention from my chunk of each stream (see the module docstring)."""

    def __init__(self, mesh: SequenceMesh, state: ShardState, original):
        self.mesh, self.state, self.original = mesh, state, original

    def __call__(self, attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor = None,
                 encoder_hidden_states_mask: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 image_rotary_emb=None) -> tuple[torch.Tensor, torch.Tensor]:
        shard = self.state.shard
        if shard is None:
            return self.original(attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                                 attention_mask, image_rotary_emb)
        if attention_mask is not None:
            raise RuntimeError("Qwen Ulysses attention: an external attention_mask is not supported")
        from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

        img, txt = joint_projections(attn, hidden_states, encoder_hidden_states)
        if image_rotary_emb is not None:                   # my rows of the image and text tables
            for qkv, freqs in zip((img, txt), image_rotary_emb, strict=True):
                qkv[0], qkv[1] = (apply_rotary_emb_qwen(t, freqs, use_real=False) for t in qkv[:2])
        query, key, value = (torch.cat([t, i], dim=1) for t, i in zip(txt, img, strict=True))
        counts = [t + i for t, i in zip(shard.text, shard.image, strict=True)]
        out = self.mesh.attention(query, key, value, counts, shard.key_mask).flatten(2, 3).to(query.dtype)
        text_len = encoder_hidden_states.shape[1]
        image = attn.to_out[0](out[:, text_len:].contiguous())
        if len(attn.to_out) > 1:
            image = attn.to_out[1](image)                                  # dropout
        return image, attn.to_add_out(out[:, :text_len].contiguous())


def split_qwen(mesh: SequenceMesh, args: tuple, kwargs: dict) -> Shard | None:
    """The split rule: both streams (ulysses_joint.split_streams), my rows of both rotary tables, and the key
    mask over every rank's [text ‖ image] tokens when the text has one."""
    shard = split_streams(mesh, args, kwargs)
    if shard is None:
        return None
    degree, rank = mesh.sp_size, mesh.sp_rank
    if kwargs.get("image_rotary_emb") is not None:
        rows = tuple(torch.tensor_split(table, degree)[rank] for table in kwargs["image_rotary_emb"])
        shard.kwargs["image_rotary_emb"] = shard.later["image_rotary_emb"] = rows
    if kwargs.get("encoder_hidden_states_mask") is not None:
        text = torch.tensor_split(kwargs["encoder_hidden_states_mask"].bool(), degree, dim=1)
        shard.key_mask = torch.cat([part for t, n in zip(text, shard.image, strict=True)
                                    for part in (t, t.new_ones((t.shape[0], n)))], dim=1)
    return shard


def enable_qwen_sequence_parallel(transformer: torch.nn.Module, ulysses_degree: int, make_mesh) -> None:
    """Shard every block of a QwenImageTransformer2DModel over the mesh ``make_mesh()`` builds once
    everything is validated (ConfigError where it cannot; ``ulysses_degree`` must divide the heads)."""
    sequence_shard.install(transformer, make_mesh, lambda: [_plan(transformer, ulysses_degree)])


def _plan(transformer: torch.nn.Module, degree: int) -> Sharded:
    name = type(transformer).__name__
    blocks = list(getattr(transformer, "transformer_blocks", ()))
    if name != "QwenImageTransformer2DModel" or not blocks:
        raise ConfigError(f"Qwen Ulysses: {name} is not a QwenImageTransformer2DModel with transformer_blocks")
    if getattr(transformer.config, "zero_cond_t", False):
        raise ConfigError("Qwen Ulysses: zero_cond_t modulates per image token (modulate_index); not supported")
    for i, block in enumerate(blocks):
        check_ulysses_heads(block.attn.heads, degree)
        if block.attn.norm_cross is not None or block.attn.spatial_norm is not None:
            raise ConfigError(f"Qwen Ulysses: transformer_blocks.{i}.attn uses norm_cross/spatial_norm")
    return Sharded(name, blocks, transformer.proj_out, [block.attn for block in blocks],
                   lambda mesh, state, attn: QwenUlyssesAttnProcessor(mesh, state, attn.processor), split_qwen)
