"""Ulysses sequence parallelism for Qwen-Image's dual-stream MMDiT (QwenImageTransformer2DModel).

Each block attends over the JOINT sequence ``[text ; image]``. The image tokens (thousands) are sharded
across the P ranks of the group; the text tokens (tens to hundreds, of varying length) stay whole on
every rank — no padding of prompts to a multiple of P, the key mask needs no sharding, and the text
stream stays identical on all ranks::

    transformer_blocks[0] pre-hook   image hidden states (B, S, C) → my token chunk (B, S/P, C)
    each block                       modulation, norms, MLPs: token-local (image: S/P tokens; text: all)
    joint attention (processor)      image q,k,v of my tokens ── all_to_all ──▶ all S tokens, my H/P heads
                                     text q,k,v computed whole, my H/P heads sliced locally
                                     SDPA over [text ; image] (key mask over the whole joint sequence)
                                     image out ── all_to_all ──▶ my tokens, all heads → to_out
                                     text out (T, H/P heads) ── all_gather over heads ──▶ (T, H) → to_add_out
    transformer_blocks[-1] hook      image hidden states (B, S/P, C) → all_gather over tokens → (B, S, C)

Rotary embeddings: the image frequencies are sliced to my token chunk; the text ones are used whole.
A call whose image sequence S is not divisible by P runs unsharded on every rank (the same decision
everywhere: S is in the shapes every rank shares), through the model's own processor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

from stage_runtime.distributed.comm import all_gather_cat, all_to_all_dim0, group_rank, group_size
from stage_runtime.distributed.ulysses import check_ulysses_heads
from stage_runtime.errors import ConfigError

_MARK = "_diffstage_ulysses"


class _ShardState:
    def __init__(self) -> None:
        self.active = False


class QwenUlyssesAttnProcessor:
    """Joint text+image attention from an image-token shard (see the module docstring)."""

    def __init__(self, group, degree: int, rank: int, state: _ShardState, original):
        self.group, self.degree, self.rank, self.state, self.original = group, degree, rank, state, original

    def __call__(self, attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor = None,
                 encoder_hidden_states_mask: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 image_rotary_emb=None) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.state.active:
            return self.original(attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                                 attention_mask, image_rotary_emb)
        if attention_mask is not None:
            raise RuntimeError("Qwen Ulysses attention: an external attention_mask is not supported")
        batch, local, _ = hidden_states.shape
        tokens, seq_txt = local * self.degree, encoder_hidden_states.shape[1]
        heads, head_dim = attn.heads // self.degree, attn.inner_dim // attn.heads
        img = [proj(hidden_states).unflatten(-1, (-1, head_dim)) for proj in (attn.to_q, attn.to_k, attn.to_v)]
        txt = [proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))
               for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
        for i, (norm_img, norm_txt) in enumerate(((attn.norm_q, attn.norm_added_q), (attn.norm_k, attn.norm_added_k))):
            img[i] = img[i] if norm_img is None else norm_img(img[i])
            txt[i] = txt[i] if norm_txt is None else norm_txt(txt[i])
        if image_rotary_emb is not None:
            img_freqs, txt_freqs = image_rotary_emb
            mine = img_freqs[self.rank * local:(self.rank + 1) * local]
            img[0], img[1] = (apply_rotary_emb_qwen(t, mine, use_real=False) for t in img[:2])
            txt[0], txt[1] = (apply_rotary_emb_qwen(t, txt_freqs, use_real=False) for t in txt[:2])
        # image q,k,v (3, B, S/P, H, D) → head group j to rank j → (3, B, S, H/P, D)
        qkv = torch.stack(img).view(3, batch, local, self.degree, heads, head_dim).permute(3, 0, 1, 2, 4, 5)
        qkv = all_to_all_dim0(qkv, self.group).permute(1, 2, 0, 3, 4, 5).reshape(3, batch, tokens, heads, head_dim)
        group = slice(self.rank * heads, (self.rank + 1) * heads)
        joint = [torch.cat([t[:, :, group], i], dim=1).transpose(1, 2) for t, i in zip(txt, qkv.unbind(0))]
        mask = None
        if encoder_hidden_states_mask is not None:
            image_mask = torch.ones((batch, tokens), dtype=torch.bool, device=hidden_states.device)
            mask = torch.cat([encoder_hidden_states_mask.bool(), image_mask], dim=1)[:, None, None, :]
        out = F.scaled_dot_product_attention(*joint, attn_mask=mask, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).to(joint[0].dtype)                                  # (B, T + S, H/P, D)
        txt_out, img_out = out[:, :seq_txt], out[:, seq_txt:]
        # image (B, S, H/P, D) → token chunk j to rank j → (B, S/P, H, D)
        img_out = img_out.reshape(batch, self.degree, local, heads, head_dim).transpose(0, 1)
        img_out = all_to_all_dim0(img_out, self.group).permute(1, 2, 0, 3, 4).reshape(batch, local, -1)
        txt_out = all_gather_cat(txt_out.contiguous(), self.group, dim=2).reshape(batch, seq_txt, -1)
        img_out = attn.to_out[0](img_out.contiguous())
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)
        return img_out, attn.to_add_out(txt_out.contiguous())


def enable_qwen_ulysses(transformer: torch.nn.Module, group, degree: int) -> None:
    """Install Ulysses on every block of a QwenImageTransformer2DModel (ConfigError where it cannot)."""
    if degree == 1:
        return
    name = type(transformer).__name__
    if getattr(transformer, _MARK, False):
        raise ConfigError(f"Ulysses is already enabled on this {name}")
    blocks = list(getattr(transformer, "transformer_blocks", ()))
    if name != "QwenImageTransformer2DModel" or not blocks:
        raise ConfigError(f"Qwen Ulysses: {name} is not a QwenImageTransformer2DModel with transformer_blocks")
    if getattr(transformer.config, "zero_cond_t", False):
        raise ConfigError("Qwen Ulysses: zero_cond_t modulates per image token (modulate_index); not supported")
    for i, block in enumerate(blocks):
        check_ulysses_heads(block.attn.heads, degree)
        if block.attn.norm_cross is not None or block.attn.spatial_norm is not None:
            raise ConfigError(f"Qwen Ulysses: transformer_blocks.{i}.attn uses norm_cross/spatial_norm")
    if group is None or group_size(group) != degree:
        raise ConfigError(f"ulysses_degree={degree} needs a sequence-parallel group of {degree} ranks")
    rank, state = group_rank(group), _ShardState()
    processors = []
    for block in blocks:
        processor = QwenUlyssesAttnProcessor(group, degree, rank, state, block.attn.processor)
        block.attn.set_processor(processor)
        processors.append((block.attn, processor))

    def shard(_module, args, kwargs):
        for attn, processor in processors:
            if attn.processor is not processor:
                raise RuntimeError(f"Ulysses: the attention processor of {name} was replaced by "
                                   f"{type(attn.processor).__name__} after enable_ulysses(); sequence "
                                   "sharding needs QwenUlyssesAttnProcessor")
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        state.active = hidden.ndim == 3 and hidden.shape[1] % degree == 0
        if not state.active:
            return None
        local = hidden.chunk(degree, dim=1)[rank]
        return ((local, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": local})

    def gather(_module, _args, output):
        if not state.active:
            return None
        state.active = False
        encoder_hidden_states, hidden_states = output
        return encoder_hidden_states, all_gather_cat(hidden_states, group, dim=1)

    blocks[0].register_forward_pre_hook(shard, with_kwargs=True)
    blocks[-1].register_forward_hook(gather)
    setattr(transformer, _MARK, True)
