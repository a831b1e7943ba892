"""Per-request block cache for transformer denoisers (First-Block-Cache / TeaCache family).

Each denoising step runs the denoiser's first block for every row; then, per request, the relative L1
change of that block's residual (output − input, image stream) against the request's last *computed*
step decides: under the threshold the other blocks are skipped for the request's rows and the cached
residual of those blocks (last block output − first block output) is added instead; otherwise they run
and the cache is refreshed. The first ``warmup_steps`` and last ``final_steps`` steps always run.

The state lives with the request (``StepRequestState.cache`` in step mode, one call's table in request
mode), one entry per CFG branch (the rows of one guidance half never see the other's residual), so
requests with different thresholds, steps and cache on/off share one fused forward:

    rows of the fused forward     [ request A: branch 0 | branch 1 ][ request B ][ request C (cache off) ]
    first block                   every row
    decide                        A skips, B computes, C always computes
    blocks 1..N−1                 only the rows that compute (index_select of every per-row tensor)
    after the last block          skipped rows = first-block output + their cached residual

A denoiser whose rows are padded to the longest of the forward (Z-Image's [image ‖ caption] tokens) names the
leading tokens that carry the image (``adapter.cache_tokens``): the signal and the residuals cover only those, so
their shape does not change as batch-mates with longer captions come and go.

The session overrides each block's ``forward`` for one call and restores it after (a compiled block's own instance
``forward`` included: the skip logic runs eagerly around the compiled block), so the transformer's
own ``forward`` (diffusers' code) runs unchanged around the blocks, hooks on the blocks still fire, and
when every row computes every block gets exactly its usual arguments: threshold 0 is bitwise no cache.

A routed denoiser (models.routed: Wan 2.2's two experts, each row on the expert of its timestep) gets one
session per part call, over that part's blocks and rows; a branch is keyed by its part too, so the step on
which a request's rows first reach the other expert is computed there and starts that expert's reference
and residual: a residual never crosses experts.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from stage_runtime.config import CacheConfig, StageConfig
from stage_runtime.models.routed import RoutedDenoiser
from stage_runtime.request import DiffusionRequest, RequestCache


@dataclass(frozen=True)
class BlockCachePolicy:
    threshold: float
    warmup_steps: int = 1
    final_steps: int = 1
    max_consecutive_skips: int = 0          # 0: no limit


def request_policy(defaults: CacheConfig, request: DiffusionRequest) -> BlockCachePolicy | None:
    """The request's effective policy: its own ``cache`` field over the stage's ``cache`` section."""
    asked = request.sampling.cache
    if asked == "off" or (asked is None and defaults.mode != "block"):
        return None
    threshold = asked.threshold if isinstance(asked, RequestCache) else defaults.threshold
    return BlockCachePolicy(threshold, defaults.warmup_steps, defaults.final_steps, defaults.max_consecutive_skips)


def block_cache_refusal(adapter, config: StageConfig) -> str | None:
    """Why this stage cannot run the block cache (said at startup or in a 400), or None."""
    family = type(adapter.pipe).__name__
    if not getattr(adapter, "supports_block_cache", False):
        return f"{family} has no block cache (it is served for transformer families: DiT, SD3, FLUX, Qwen-Image, Wan)"
    if min(len(blocks) for blocks in part_blocks(adapter).values()) < 2:
        return f"{family}'s denoiser has fewer than 2 blocks: nothing to skip"
    p = config.parallel
    for name, degree in (("cfg_parallel_size", p.cfg_parallel_size), ("ulysses_degree", p.ulysses_degree),
                         ("ring_degree", p.ring_degree), ("tensor_parallel_size", p.tensor_parallel_size)):
        if degree > 1:
            return f"the block cache runs on one rank per model copy, not with {name}={degree}"
    if config.offload.mode == "layerwise":
        return "the block cache is not supported with offload.mode=layerwise"
    return None


def part_blocks(adapter) -> dict[str, list[torch.nn.Module]]:
    """The denoiser's blocks in execution order (the family's ``block_lists``, else ``transformer_blocks``), per
    component holding them: the denoiser, or each part of a routed one (Wan 2.2's experts)."""
    out = {}
    for part, module in adapter.block_holders().items():
        out[part] = [block for name in adapter.block_lists or ("transformer_blocks",)
                     for block in getattr(module, name, None) or ()]
    return out


def cache_blocks(adapter, part: str | None = None) -> list[torch.nn.Module]:
    """The blocks of the denoiser (of its part ``part``; the first by default)."""
    blocks = part_blocks(adapter)
    return blocks[part] if part is not None else next(iter(blocks.values()))


@dataclass(eq=False)
class BlockCacheState:
    """One request's block cache: per branch (CFG half; under a routed denoiser, the part and the half) the last
    computed step's signal and residual."""

    policy: BlockCachePolicy
    num_steps: int
    step: int = 0                            # forwards this request took part in
    computed: int = 0
    skipped: int = 0
    consecutive: int = 0                     # skips since the last computed step
    last_distance: float | None = None
    reference: dict[int, torch.Tensor] = field(default_factory=dict)   # branch → first-block residual
    residual: dict[int, torch.Tensor] = field(default_factory=dict)    # branch → rest-of-blocks residual

    def decide(self, signals: dict[int, torch.Tensor]) -> bool:
        """This step's choice for the request (True: skip the rest of the blocks); counts it."""
        p, step = self.policy, self.step
        self.step += 1
        forced = (step < p.warmup_steps or step >= self.num_steps - p.final_steps
                  or set(signals) != set(self.residual)
                  or (p.max_consecutive_skips and self.consecutive >= p.max_consecutive_skips))
        self.last_distance = None if forced else max(relative_l1(signals[b], self.reference[b]) for b in signals)
        skip = self.last_distance is not None and self.last_distance < p.threshold
        if skip:
            self.skipped += 1
            self.consecutive += 1
        else:
            self.computed += 1
            self.consecutive = 0
            self.reference = {b: t.clone() for b, t in signals.items()}
            self.residual = {b: t for b, t in self.residual.items() if b in signals}   # another part's: never again
        return skip

    def counts(self) -> dict[str, int]:
        return {"steps_computed": self.computed, "steps_skipped": self.skipped}

    def tensors_nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.reference.values(), *self.residual.values()))

    def move_to(self, device: torch.device) -> None:
        """With its step state (a preempted request's host offload, and back): copies, so values stay exact."""
        self.reference = {b: t.to(device, copy=True) for b, t in self.reference.items()}
        self.residual = {b: t.to(device, copy=True) for b, t in self.residual.items()}

    def snapshot(self) -> tuple:
        return (self.step, self.computed, self.skipped, self.consecutive, self.last_distance,
                dict(self.reference), dict(self.residual))

    def restore(self, snap: tuple) -> None:
        (self.step, self.computed, self.skipped, self.consecutive, self.last_distance,
         self.reference, self.residual) = snap


def relative_l1(current: torch.Tensor, reference: torch.Tensor) -> float:
    scale = reference.abs().mean()
    return float((current - reference).abs().mean() / scale) if float(scale) else float("inf")


@dataclass(frozen=True, eq=False)
class RowSegment:
    """Rows [start, start + count) of the fused forward: one CFG branch of one request (cache None: off)."""

    cache: BlockCacheState | None
    branch: int
    start: int
    count: int


def segments(entries: list[tuple[BlockCacheState | None, int, int]]) -> list[RowSegment]:
    """(cache, branch, rows) in row order → segments with their offsets."""
    out, start = [], 0
    for cache, branch, count in entries:
        out.append(RowSegment(cache, branch, start, count))
        start += count
    return out


def step_rows(states) -> list[RowSegment]:
    """Step mode: every family puts a request's rows together, its CFG halves one after the other."""
    entries = []
    for st in states:
        n = len(st.latents)
        entries.extend([(st.cache, 0, n), (st.cache, 1, n)] if st.do_cfg else [(st.cache, 0, n)])
    return segments(entries)


def wave_rows(adapter, requests: list[DiffusionRequest], caches: dict[str, BlockCacheState]) -> list[RowSegment]:
    """Request mode: a diffusers CFG pipeline stacks one guidance half of every image, then the other
    (``torch.cat([latents] * 2)``); a true-CFG family running its own step loop (Qwen-Image; FLUX.1 for a wave
    with ``true_cfg_scale``) and a family whose request mode is the step contract's loop (Wan) keep each request's
    halves together; a distilled or unguided one has one row per image."""
    s = requests[0].sampling
    guided = s.guidance_scale > adapter.cfg_above
    if adapter.guidance == "cfg" and guided and not adapter.request_mode_step_loop:
        return segments([(caches.get(r.request_id), b, r.sampling.num_outputs) for b in (0, 1) for r in requests])
    halves = (0, 1) if s.runs_true_cfg or guided and (adapter.guidance == "true_cfg" or
                                                       adapter.request_mode_step_loop) else (0,)
    return segments([(caches.get(r.request_id), b, r.sampling.num_outputs) for r in requests for b in halves])


def new_cache(defaults: CacheConfig, request: DiffusionRequest, refusal: str | None) -> BlockCacheState | None:
    """A request's cache state, or None when its policy is off (or the stage cannot run the cache)."""
    policy = request_policy(defaults, request)
    return None if policy is None or refusal else BlockCacheState(policy, request.num_steps)


def session(adapter, rows: list[RowSegment]):
    """The block-cache session for one call, or a no-op when no row has a cache."""
    if all(s.cache is None for s in rows):
        return contextlib.nullcontext()
    loras = getattr(adapter, "loras", None)    # LoRA row plans follow the computing rows (models.lora)
    if isinstance(adapter.denoiser, RoutedDenoiser):
        return RoutedCacheSession(adapter.denoiser, part_blocks(adapter), rows, loras)
    subset = None if loras is None else (lambda keep: loras.subset(adapter.denoiser, keep))
    return BlockCacheSession(cache_blocks(adapter), rows, subset, lambda: adapter.cache_tokens)


def _image(out: Any) -> torch.Tensor:
    """A block's image stream: the tensor itself, or the second of (encoder, image) (MMDiT blocks)."""
    return out[1] if isinstance(out, tuple) else out


def _image_input(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


class BlockCacheSession:
    """Installs the per-row skip on the denoiser's blocks for one call (a tick, or a whole wave)."""

    def __init__(self, blocks: list[torch.nn.Module], rows: list[RowSegment], subset=None, tokens=None):
        self.blocks = blocks
        self.subset = subset or (lambda keep: contextlib.nullcontext())   # per-row state that follows the rows
        self.tokens = tokens or (lambda: None)     # the leading tokens compared and carried (adapter.cache_tokens)
        self.rows = rows
        self.total = sum(s.count for s in rows)
        self.caches = list({id(s.cache): s.cache for s in rows if s.cache is not None}.values())
        self._snapshots: list[tuple] = []
        self._reset()

    def _reset(self) -> None:
        self.compute: torch.Tensor | None = None   # rows that run blocks 1..N−1 (None: all of them)
        self.skipping: list[RowSegment] = []
        self.first: torch.Tensor | None = None     # the first block's image output, every row
        self.pairs = False                          # blocks return (encoder, image) rather than the image
        self.span = slice(None)                     # the tokens (dim 1) the signal and the residuals cover

    def __enter__(self) -> "BlockCacheSession":
        self._snapshots = [c.snapshot() for c in self.caches]
        self._own = [block.__dict__.get("forward") for block in self.blocks]    # a compiled block's (compilation)
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            original = block.forward
            if i == 0:
                block.forward = lambda *a, _f=original, **k: self._first(_f, a, k)
            else:
                block.forward = lambda *a, _f=original, _last=(i == last), **k: self._rest(_f, _last, a, k)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for block, own in zip(self.blocks, self._own, strict=True):
            if own is None:
                block.__dict__.pop("forward", None)
            else:
                block.forward = own
        if exc_type is not None:               # a failed call changes no request's cache
            for cache, snap in zip(self.caches, self._snapshots, strict=True):
                cache.restore(snap)
        self._reset()

    # -- the block overrides -------------------------------------------------------------------------------
    def _first(self, forward, args: tuple, kwargs: dict) -> Any:
        before = _image_input(args, kwargs)
        out = forward(*args, **kwargs)
        after = _image(out)
        if len(after) != self.total:
            raise RuntimeError(f"block cache: the forward has {len(after)} rows, the row plan {self.total}")
        self.span = slice(None) if (tokens := self.tokens()) is None else slice(0, tokens)
        signal = (after - before)[:, self.span]
        skip_ids: set[int] = set()
        for cache in self.caches:
            mine = [s for s in self.rows if s.cache is cache]
            if cache.decide({s.branch: signal[s.start:s.start + s.count] for s in mine}):
                skip_ids.add(id(cache))
        self.skipping = [s for s in self.rows if s.cache is not None and id(s.cache) in skip_ids]
        self.first, self.pairs = after, isinstance(out, tuple)
        if self.skipping:
            keep = torch.ones(self.total, dtype=torch.bool)
            for s in self.skipping:
                keep[s.start:s.start + s.count] = False
            self.compute = keep.nonzero().flatten().to(after.device)
        else:
            self.compute = None
        return out

    def _rest(self, forward, last: bool, args: tuple, kwargs: dict) -> Any:
        if self.compute is None:
            out = forward(*args, **kwargs)
        else:
            args = tuple(self._take(a) for a in args)
            kwargs = {k: self._take(v) for k, v in kwargs.items()}
            if len(self.compute):
                with self.subset(self.compute):
                    out = forward(*args, **kwargs)
            else:                              # every row skips: the block's output shape, no work
                image = _image_input(args, kwargs)
                out = (kwargs.get("encoder_hidden_states"), image) if self._pair_out(kwargs) else image
        return self._finish(out) if last else out

    def _pair_out(self, kwargs: dict) -> bool:
        """Whether this block returns (encoder, image): as the first block did, unless it takes the joint stream
        (``encoder_hidden_states=None``: FLUX.2's single-stream blocks, after double-stream ones)."""
        return self.pairs and not ("encoder_hidden_states" in kwargs and kwargs["encoder_hidden_states"] is None)

    def _take(self, value: Any) -> Any:
        """The computing rows of a per-row tensor (dim 0 = the forward's rows); anything else as it is."""
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == self.total:
            return value.index_select(0, self.compute)
        return value

    def _finish(self, out: Any) -> Any:
        """After the last block: refresh computed rows' residuals, rebuild skipped rows, every row back. A last block
        returning one tensor longer than the first block's image stream returns the joint [text ‖ image] tokens
        (FLUX.2's single-stream blocks): its image stream is the last tokens; a skipped row's text tokens are unused
        (the transformer drops them) and left zero."""
        stream = _image(out)
        joint = not isinstance(out, tuple) and stream.shape[1] > self.first.shape[1]
        image = stream[:, stream.shape[1] - self.first.shape[1]:] if joint else stream
        full = image
        if self.compute is not None:
            full = self.first.clone()
            full.index_copy_(0, self.compute, image)
            for s in self.skipping:
                rows = slice(s.start, s.start + s.count)
                full[rows, self.span] = self.first[rows, self.span] + s.cache.residual[s.branch]
        for s in self.rows:
            if s.cache is not None and s not in self.skipping:
                at = s.start if self.compute is None else int((self.compute < s.start).sum())
                s.cache.residual[s.branch] = (image[at:at + s.count] - self.first[s.start:s.start + s.count])[
                    :, self.span]
        if joint and self.compute is not None:
            whole = stream.new_zeros((self.total, *stream.shape[1:]))
            whole.index_copy_(0, self.compute, stream)
            whole[:, stream.shape[1] - image.shape[1]:] = full
            return whole
        if not isinstance(out, tuple):
            return stream if joint else full
        encoder = out[0]
        if encoder is not None and self.compute is not None:
            whole = encoder.new_zeros((self.total, *encoder.shape[1:]))   # skipped rows' text stream is unused
            whole.index_copy_(0, self.compute, encoder)
            encoder = whole
        return (encoder, full, *out[2:])


def routed_rows(rows: list[RowSegment], keep: torch.Tensor | None, part: str) -> list[RowSegment]:
    """The segments of the rows ``keep`` (None: all) a routed denoiser sends to ``part``, renumbered, each branch
    keyed by the part too: a request whose rows move to the other part has no residual there, so it computes."""
    if keep is None:
        return [RowSegment(s.cache, (part, s.branch), s.start, s.count) for s in rows]
    position = {row: i for i, row in enumerate(keep.tolist())}
    out = []
    for s in rows:
        inside = [row in position for row in range(s.start, s.start + s.count)]
        if any(inside) and not all(inside):
            raise RuntimeError(f"block cache: rows {s.start}..{s.start + s.count - 1} of one request's branch were "
                               f"routed to two parts of the denoiser")
        if inside and all(inside):
            out.append(RowSegment(s.cache, (part, s.branch), position[s.start], s.count))
    return out


class RoutedCacheSession:
    """The block cache over a routed denoiser (models.routed): around each part's call, a BlockCacheSession over
    that part's blocks and the rows routed to it (its LoRA plan following the computing rows). A failed call
    changes no request's cache, whichever part it failed in."""

    def __init__(self, denoiser: RoutedDenoiser, blocks: dict[str, list[torch.nn.Module]], rows: list[RowSegment],
                 loras=None):
        self.denoiser, self.blocks, self.rows, self.loras = denoiser, blocks, rows, loras
        self.caches = list({id(s.cache): s.cache for s in rows if s.cache is not None}.values())
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "RoutedCacheSession":
        self._snapshots = [c.snapshot() for c in self.caches]
        self._stack.enter_context(self.denoiser.around_each(self._part))
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stack.close()
        if exc_type is not None:
            for cache, snap in zip(self.caches, self._snapshots, strict=True):
                cache.restore(snap)

    def _part(self, name: str, keep: torch.Tensor | None):
        rows = routed_rows(self.rows, keep, name)
        if all(s.cache is None for s in rows):
            return contextlib.nullcontext()
        module = self.denoiser.parts()[name]
        subset = None if self.loras is None else (lambda k: self.loras.subset(module, k))
        return BlockCacheSession(self.blocks[name], rows, subset)
