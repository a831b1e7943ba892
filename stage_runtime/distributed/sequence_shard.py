"""The skeleton every sequence-parallel installer shares (Ulysses, ring, Ulysses × ring over a
distributed.usp.SequenceMesh). An installer brings only its attention processor and its split rule: here
ulysses.py (UNet/DiT self-attention) and ulysses_joint.py (SD3 and FLUX.1); a family with an attention of its own
has its installer in its family module (models/families/: Qwen-Image, Z-Image, FLUX.2, HunyuanVideo-1.5, and Wan's
in wan_ulysses.py), named by its adapter's ``sequence_parallel``.

Per transformer (one ``Sharded``)::

    blocks[0] pre-hook          the processor guard; then ``split(mesh, args, kwargs)``: this rank's chunk of
                                each token stream (a Shard), or None: this call runs unsharded on every rank
                                (the rule decides from shapes every rank shares, so all decide alike)
    blocks[1:] pre-hooks        the Shard's ``later`` arguments instead of the full ones (e.g. my rotary rows;
                                by keyword name, or by position for blocks called positionally: Wan)
    every attention             the family's processor, which reads ``state.shard``
    ``gather_at`` forward hook  my image tokens → all_gather (uneven counts) → every token, on every rank (None: the
                                tokens stay sharded for another Sharded of the same call: Wan VACE's hints)

:func:`install` validates before it installs anything: the family's plan (heads, processor classes, block
features) raises ConfigError first, then the mesh is built (its group checks), then the processors and
hooks go in and the module is marked, so a second install is a ConfigError. A processor replaced after
install (e.g. ``set_attn_processor``) makes the next call raise: sharding without it would be wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from stage_runtime.distributed.comm import all_gather_tokens
from stage_runtime.distributed.usp import SequenceMesh
from stage_runtime.errors import ConfigError

_MARK = "_diffstage_sequence_parallel"


def check_ulysses_heads(num_heads: int, degree: int) -> None:
    """ConfigError unless the Ulysses degree divides the attention head count."""
    if degree < 1 or num_heads % degree:
        raise ConfigError(f"ulysses_degree={degree} does not divide the model's attention heads "
                          f"(num_attention_heads={num_heads}): Ulysses splits heads across ranks")


@dataclass
class Shard:
    """One transformer call, split: this rank's arguments for the first block; every sp rank's token count of
    the image stream (the one gathered at the end) and of the text stream (joint models; else empty); what
    later blocks get instead of the full arguments (keyword name or position → value, see :func:`override`);
    the key mask over every rank's tokens (Qwen-Image)."""

    args: tuple
    kwargs: dict
    image: list[int]
    text: list[int] = field(default_factory=list)
    later: dict = field(default_factory=dict)
    key_mask: torch.Tensor | None = None


def override(args: tuple, kwargs: dict, changes: dict) -> tuple[tuple, dict]:
    """(args, kwargs) with ``changes`` put in: an int key replaces that positional argument, a name the keyword."""
    return (tuple(changes.get(i, a) for i, a in enumerate(args)),
            {**kwargs, **{k: v for k, v in changes.items() if isinstance(k, str)}})


class ShardState:
    """The current call of one sharded transformer: its Shard, or None while it runs unsharded."""

    def __init__(self) -> None:
        self.shard: Shard | None = None


@dataclass
class Sharded:
    """One validated transformer (or branch of one) to shard: its name (in errors), its blocks in call order, the
    module whose output holds the image tokens to gather (None: none, its outputs stay sharded), the attentions whose
    processor ``processor(mesh, state, attn)`` replaces, and the family's split rule."""

    name: str
    blocks: list[torch.nn.Module]
    gather_at: torch.nn.Module | None
    attentions: list[torch.nn.Module]
    processor: Callable[[SequenceMesh, ShardState, torch.nn.Module], object]
    split: Callable[[SequenceMesh, tuple, dict], Shard | None]


def install(module: torch.nn.Module, make_mesh: Callable[[], SequenceMesh],
            plan: Callable[[], list[Sharded]]) -> None:
    """Shard the transformers ``plan()`` names (it validates: ConfigError before anything is installed) over
    the mesh ``make_mesh()`` builds then. ConfigError if ``module`` is already sharded."""
    if getattr(module, _MARK, False):
        raise ConfigError(f"sequence parallelism (Ulysses / ring) is already enabled on this {type(module).__name__}")
    targets = plan()
    mesh = make_mesh()
    for target in targets:
        _install(target, mesh)
    setattr(module, _MARK, True)


def _install(target: Sharded, mesh: SequenceMesh) -> None:
    state = ShardState()
    processors = [(attn, target.processor(mesh, state, attn)) for attn in target.attentions]

    def shard(_module, args, kwargs):
        for attn, processor in processors:
            if attn.processor is not processor:
                raise RuntimeError(f"Ulysses: the attention processor of {target.name} was replaced by "
                                   f"{type(attn.processor).__name__} after enable_ulysses(); sequence sharding "
                                   f"needs {type(processor).__name__}")
        state.shard = target.split(mesh, args, kwargs)
        return None if state.shard is None else (state.shard.args, state.shard.kwargs)

    def later(_module, args, kwargs):
        return None if state.shard is None or not state.shard.later else override(args, kwargs, state.shard.later)

    def gather(_module, _args, output):
        shard, state.shard = state.shard, None
        return None if shard is None else all_gather_tokens(output, shard.image, mesh.sp_group)

    for attn, processor in processors:
        attn.set_processor(processor)
    target.blocks[0].register_forward_pre_hook(shard, with_kwargs=True)
    for block in target.blocks[1:]:
        block.register_forward_pre_hook(later, with_kwargs=True)
    if target.gather_at is not None:
        target.gather_at.register_forward_hook(gather)
