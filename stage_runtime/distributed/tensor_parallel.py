"""Tensor parallelism for the transformer blocks: heads and MLP hidden units split across the TP group.

Megatron-style, per attention and per feed-forward of the denoiser (T ranks, rank t)::

    attention   to_q, to_k, to_v (and add_q/k/v_proj)   column-parallel: rows of head group t → H/T local heads
                per-head q/k norms, SDPA                  local (the family's own processor, attn.heads = H/T)
                to_out[0] (and to_add_out)                row-parallel: my H/T · D input columns,
                                                          ONE all_reduce (sum), then the bias once
    feed-forward act.proj (GELU, GEGLU, …)                column-parallel: my F/T hidden units (both halves of
                                                          a gated activation)
                net[2]                                    row-parallel: ONE all_reduce, then the bias
    FLUX single  proj_mlp, attn.to_q/k/v (pre_only)        column-parallel
    block        proj_out over [attention ‖ MLP]          row-parallel over my columns of both parts

A LoRA adapter on a sharded layer is cut the same way (``shard_low_rank``: B's rows of a column-parallel layer, A's
columns of a row-parallel one, whose delta joins the partial product before its all_reduce: ``partial_hooks``).
Everything else (norms, modulation, embeddings, proj_out, text encoders, VAE) stays replicated, so each
block's output is the same on every rank. Weights are cut at load from the full checkpoint (the full
tensors are dropped once sliced). Head counts and hidden sizes the degree does not divide are refused
(ConfigError naming the module and both numbers) before anything is changed. Supported attentions:
diffusers' default processors of DiT/SD (AttnProcessor2_0), SD3 (JointAttnProcessor2_0) and FLUX.1
(FluxAttnProcessor).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.activations import GEGLU, GELU, ApproximateGELU, LinearActivation, SwiGLU
from diffusers.models.attention import FeedForward
from diffusers.models.attention_processor import Attention

from stage_runtime.distributed.comm import all_reduce_sum, group_rank, group_size
from stage_runtime.errors import ConfigError

_MARK = "_diffstage_tensor_parallel"
_PROCESSORS = ("AttnProcessor2_0", "JointAttnProcessor2_0", "FluxAttnProcessor")
_GATED = (GEGLU, SwiGLU)
_ACTIVATIONS = (GELU, ApproximateGELU, LinearActivation, *_GATED)
_COLUMN = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")


class ColumnParallelLinear(torch.nn.Linear):
    """A Linear holding output rows ``rows`` of the full layer (no communication)."""

    @classmethod
    def shard(cls, full: torch.nn.Linear, rows: torch.Tensor) -> ColumnParallelLinear:
        layer = cls(full.in_features, len(rows), bias=full.bias is not None, device="meta")
        layer.weight = torch.nn.Parameter(full.weight.detach()[rows].clone(), requires_grad=False)
        if full.bias is not None:
            layer.bias = torch.nn.Parameter(full.bias.detach()[rows].clone(), requires_grad=False)
        layer.rows, layer.full_in_features, layer.full_out_features = rows, full.in_features, full.out_features
        return layer

    def shard_low_rank(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a low-rank update ``B @ A`` of the full weight (a LoRA): B's rows of my outputs."""
        return a, b[self.rows.to(b.device)]


class RowParallelLinear(torch.nn.Linear):
    """A Linear holding input columns ``cols`` of the full layer: partial product, one all_reduce, bias.

    ``partial_hooks`` (called as forward hooks are, ``hook(module, (x,), partial)``) add to the partial product
    before the all_reduce: a low-rank update sharded by ``shard_low_rank`` is summed by the same collective."""

    group = None

    @classmethod
    def shard(cls, full: torch.nn.Linear, cols: torch.Tensor, group) -> RowParallelLinear:
        layer = cls(len(cols), full.out_features, bias=full.bias is not None, device="meta")
        layer.weight = torch.nn.Parameter(full.weight.detach()[:, cols].clone(), requires_grad=False)
        if full.bias is not None:
            layer.bias = torch.nn.Parameter(full.bias.detach().clone(), requires_grad=False)
        layer.group = group
        layer.cols, layer.full_in_features, layer.full_out_features = cols, full.in_features, full.out_features
        layer.partial_hooks = []
        return layer

    def shard_low_rank(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a low-rank update ``B @ A`` of the full weight: A's columns of my inputs."""
        return a[:, self.cols.to(a.device)], b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        for hook in self.partial_hooks:
            partial = hook(self, (x,), partial)
        out = all_reduce_sum(partial.contiguous(), self.group)
        return out if self.bias is None else out + self.bias


def _span(total: int, parts: int, index: int, copies: int = 1) -> torch.Tensor:
    """Indices of chunk ``index`` of ``parts`` in each of ``copies`` equal consecutive halves of ``total``."""
    each = total // copies
    size = each // parts
    return torch.cat([torch.arange(c * each + index * size, c * each + (index + 1) * size) for c in range(copies)])


def _check_attention(name: str, attn: Attention, degree: int) -> None:
    processor = type(attn.processor).__name__
    if processor not in _PROCESSORS:
        raise ConfigError(f"tensor parallel: {name} uses {processor}; tensor parallel shards attentions that run "
                          f"{', '.join(_PROCESSORS)}")
    if getattr(attn, "fused_projections", False):
        raise ConfigError(f"tensor parallel: {name} has fused q/k/v projections, which it does not shard")
    if attn.heads % degree:
        raise ConfigError(f"tensor_parallel_size={degree} does not divide the attention heads of {name} "
                          f"(heads={attn.heads}): tensor parallel splits heads across ranks")
    head_dim = attn.to_q.out_features // attn.heads
    for norm_name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
        norm = getattr(attn, norm_name, None)
        weight = getattr(norm, "weight", None)
        if norm is not None and weight is not None and weight.numel() != head_dim:
            raise ConfigError(f"tensor parallel: {name}.{norm_name} normalizes across heads ({weight.numel()} "
                              f"features, head_dim={head_dim}); only per-head q/k norms are sharded")


def _check_feed_forward(name: str, ff: FeedForward, degree: int) -> None:
    act = ff.net[0]
    if not isinstance(act, _ACTIVATIONS) or not isinstance(ff.net[2], torch.nn.Linear):
        raise ConfigError(f"tensor parallel: {name} uses {type(act).__name__}, which it does not shard")
    hidden = ff.net[2].in_features
    if hidden % degree:
        raise ConfigError(f"tensor_parallel_size={degree} does not divide the feed-forward hidden size of {name} "
                          f"(inner_dim={hidden})")


def _is_attention(module: torch.nn.Module) -> bool:
    return isinstance(module, Attention) or type(module).__name__ == "FluxAttention"


def _is_single_stream(module: torch.nn.Module) -> bool:
    """FLUX's single-stream block: proj_out reads [attention output ‖ MLP hidden] concatenated."""
    return all(hasattr(module, name) for name in ("proj_mlp", "proj_out", "attn", "mlp_hidden_dim"))


def _targets(denoiser: torch.nn.Module) -> tuple[list, list, list]:
    prefix = type(denoiser).__name__
    modules = [(f"{prefix}.{n}", m) for n, m in denoiser.named_modules()]
    return ([(n, m) for n, m in modules if _is_attention(m)],
            [(n, m) for n, m in modules if isinstance(m, FeedForward)],
            [(n, m) for n, m in modules if _is_single_stream(m)])


def check_tensor_parallel(denoiser: torch.nn.Module, degree: int) -> None:
    """ConfigError for whatever of ``denoiser`` tensor parallel of ``degree`` cannot shard (nothing changed)."""
    attentions, ffs, singles = _targets(denoiser)
    if not attentions:
        raise ConfigError(f"tensor parallel: {type(denoiser).__name__} has no attention layers to shard")
    for name, attn in attentions:
        _check_attention(name, attn, degree)
        owned = any(block.attn is attn for _, block in singles)
        if not isinstance(getattr(attn, "to_out", None), torch.nn.ModuleList) and not owned:
            raise ConfigError(f"tensor parallel: {name} has no output projection to reduce over")
    for name, ff in ffs:
        _check_feed_forward(name, ff, degree)
    for name, block in singles:
        if block.mlp_hidden_dim % degree:
            raise ConfigError(f"tensor_parallel_size={degree} does not divide the MLP hidden size of {name} "
                              f"(mlp_hidden_dim={block.mlp_hidden_dim})")


def _shard_attention(attn: Attention, group, degree: int, rank: int) -> None:
    inner = attn.to_q.out_features
    rows = _span(inner, degree, rank)
    for name in _COLUMN:
        layer = getattr(attn, name, None)
        if isinstance(layer, torch.nn.Linear):
            setattr(attn, name, ColumnParallelLinear.shard(layer, _span(layer.out_features, degree, rank)))
    if isinstance(getattr(attn, "to_out", None), torch.nn.ModuleList):     # FLUX single blocks: pre_only
        attn.to_out[0] = RowParallelLinear.shard(attn.to_out[0], rows, group)
    if isinstance(getattr(attn, "to_add_out", None), torch.nn.Linear):
        attn.to_add_out = RowParallelLinear.shard(attn.to_add_out, rows, group)
    attn.heads //= degree
    attn.inner_dim //= degree
    if hasattr(attn, "inner_kv_dim"):
        attn.inner_kv_dim //= degree


def _shard_feed_forward(ff: FeedForward, group, degree: int, rank: int) -> None:
    act, hidden = ff.net[0], ff.net[2].in_features
    copies = 2 if isinstance(act, _GATED) else 1
    act.proj = ColumnParallelLinear.shard(act.proj, _span(act.proj.out_features, degree, rank, copies))
    ff.net[2] = RowParallelLinear.shard(ff.net[2], _span(hidden, degree, rank), group)


def _shard_single_stream(block: torch.nn.Module, group, degree: int, rank: int) -> None:
    inner, hidden = block.attn.inner_dim * degree, block.mlp_hidden_dim      # attn already sharded
    block.proj_mlp = ColumnParallelLinear.shard(block.proj_mlp, _span(hidden, degree, rank))
    cols = torch.cat([_span(inner, degree, rank), inner + _span(hidden, degree, rank)])
    block.proj_out = RowParallelLinear.shard(block.proj_out, cols, group)
    block.mlp_hidden_dim //= degree


def enable_tensor_parallel(denoiser: torch.nn.Module, group, degree: int) -> None:
    """Shard every attention and feed-forward of ``denoiser`` across ``group`` (see the module docstring).

    ConfigError when a head count or hidden size is not divisible by ``degree``, when a layer is of a kind
    this does not shard, or when the group has the wrong size. Validates everything before changing anything.
    """
    if degree == 1:
        return
    if getattr(denoiser, _MARK, False):
        raise ConfigError(f"tensor parallel is already enabled on this {type(denoiser).__name__}")
    check_tensor_parallel(denoiser, degree)
    if group is None or group_size(group) != degree:
        raise ConfigError(f"tensor_parallel_size={degree} needs a tensor-parallel group of {degree} ranks")
    rank = group_rank(group)
    attentions, ffs, singles = _targets(denoiser)
    for _name, attn in attentions:
        _shard_attention(attn, group, degree, rank)
    for _name, ff in ffs:
        _shard_feed_forward(ff, group, degree, rank)
    for _name, block in singles:
        _shard_single_stream(block, group, degree, rank)
    setattr(denoiser, _MARK, True)
