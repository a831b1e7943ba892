"""Z-Image (ZImagePipeline: Z-Image, Z-Image-Turbo): a single-stream DiT over each row's packed sequence
``[image tokens ‖ caption tokens]``, a Qwen3 text encoder (the prompt in its chat template; the second-to-last
hidden states of the prompt's own tokens, so every prompt has its own length), flow matching.

The transformer takes its rows as LISTS: latents ``[(C, 1, h, w)] * B``, captions ``[(T_i, D)] * B`` and a
``(B,)`` timestep; inside, each row's image tokens and caption tokens are padded to multiples of 32 (the pads
are a learned token, attended to), the caption's rotary positions come first and the image's follow them, and
rows are padded to the longest of the forward with a key mask. The output is a list of ``(C, 1, h, w)``.
One step, as diffusers' ``__call__`` computes it::

    t_model   = (1000 − t) / 1000 per row                  (the transformer multiplies by t_scale = 1000)
    rows      [latents x n ‖ latents x n] with captions [prompt x n ‖ negative x n] when guided, else the first
    guided    pred = pos + s · (pos − neg)                   per image, in float; s = guidance_scale
              (CFG runs at any s > 0: ``cfg_above = 0``; s = 0 is Z-Image-Turbo's unguided setting)
    truncate  at a step whose (1000 − t) / 1000 > cfg_truncation, s = 0 for that step: positive rows only
    normalise when cfg_normalization > 0: pred × min(1, cfg_normalization · |pos| / |pred|) (norms of the image)
    update    latents ← scheduler.step(−pred)               (the model predicts the negated velocity)

Step mode makes one forward per tick over every request's rows ``[pos x n ‖ neg x n]`` (each request at its own
timestep, guidance scale and truncation); request mode is ONE pipeline call (``[pos of every image ‖ neg of every
image]``, one transformer forward per step). ``cfg_truncation`` and ``cfg_normalization`` are served at the
pipeline's defaults (1.0: never truncated; off); no request field sets them yet (``ZImageAdapter`` subclasses
may). Timesteps are diffusers' own: sigmas ``linspace(1, 1/steps)`` and the dynamic shift of the image token
count when the scheduler asks for it (Z-Image-Turbo: a static shift 3).

LoRA adapts the transformer (``ZImageLoraLoaderMixin``'s component), per row around each forward, except its patch
and caption embedders: they run on every row's tokens concatenated, so a file adapting them is refused at load.

Sequence parallelism (Ulysses, ring, Ulysses × ring) for Z-Image's single-stream DiT
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

import numpy as np
import torch
from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

from stage_runtime.distributed import sequence_shard
from stage_runtime.distributed.sequence_shard import Shard, ShardState, Sharded, check_ulysses_heads
from stage_runtime.distributed.ulysses_joint import chunk_sizes
from stage_runtime.distributed.usp import SequenceMesh
from stage_runtime.errors import ConfigError
from stage_runtime.models.adapter import PipelineAdapter
from stage_runtime.models.flow_match import request_flow_scheduler
from stage_runtime.models.refusals import ZImageRefusals
from stage_runtime.models.step_contract import StepContract
from stage_runtime.models.step_state import StepRequestState
from stage_runtime.request import DiffusionRequest

MAX_SEQUENCE_LENGTH = 512          # ZImagePipeline.__call__'s default
ZIMAGE_MAX_SHIFT = 1.15            # calculate_shift's default top
SEQ_MULTIPLE = 32                  # the transformer pads each row's image and caption tokens to a multiple of it
PATCH = 2                          # latent pixels a side per image token


# -- sequence parallelism: the installer of the adapter's ``sequence_parallel`` (see the module docstring) ------------
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


# -- the family -------------------------------------------------------------------------------------------------------
class ZImageAdapter(ZImageRefusals, StepContract, PipelineAdapter):
    pipeline_classes = ("ZImagePipeline",)
    tiny_kinds = ("zimage",)
    default_steps, default_guidance = 50, 5.0                 # ZImagePipeline.__call__'s (Turbo: 8-9 steps, 0.0)
    guidance = "cfg"
    cfg_above = 0.0                                           # any positive scale runs the negative rows
    block_lists = ("layers",)                                 # the main single-stream layers (refiners: the head)
    parallel_kinds = frozenset({"cfg", "ulysses", "ring"})
    sequence_parallel = staticmethod(enable_zimage_sequence_parallel)     # each row's [image ‖ caption] (above)
    step_key_fields = ("height", "width")                     # timesteps, guidance and captions are per row
    lora_components = ("transformer",)                        # as ZImageLoraLoaderMixin (the Qwen3 encoder never)
    # their input is every row's patches / caption tokens concatenated (models/adapter.py, lora_flat_modules)
    lora_flat_modules = {"transformer": ("all_x_embedder", "cap_embedder", "siglip_embedder")}
    # ZImagePipeline.__call__'s defaults; not request fields (a subclass may set other values)
    cfg_truncation: float = 1.0
    cfg_normalization: float = 0.0

    @property
    def supports_block_cache(self) -> bool:
        """Over the image tokens (``cache_tokens``). Not with a CFG truncation: it drops the negative rows in the
        middle of a request-mode call, and the cache's row plan is made once per call."""
        return float(self.cfg_truncation) >= 1

    @property
    def vae_scale_factor(self) -> int:
        return int(self.pipe.vae_scale_factor)

    def size_multiple(self) -> int:
        return self.vae_scale_factor * PATCH                  # the pipeline refuses other sizes (ValueError)

    def default_size(self) -> tuple[int, int]:
        """The VAE's sample size (1024 for Z-Image's, the pipeline's own default size)."""
        side = self.pipe.vae.config.sample_size
        side = side[0] if isinstance(side, (list, tuple)) else side
        return int(side), int(side)

    def max_sequence_length(self) -> int:
        return MAX_SEQUENCE_LENGTH

    def parallel_refusal(self, kind: str) -> str | None:
        if kind == "tp":
            return ("Z-Image's blocks use their own attention processor (ZSingleStreamAttnProcessor) and a SwiGLU "
                    "feed-forward (w1, w2, w3), which distributed/tensor_parallel.py does not shard")
        return None

    def enable_cfg_parallel(self, group) -> None:
        """The transformer takes its rows as lists: split those (distributed/cfg_parallel_lists.py)."""
        from stage_runtime.distributed.cfg_parallel_lists import enable_list_cfg_parallel

        enable_list_cfg_parallel(self.denoiser, group, around_local=self.rows_on_this_rank(self.denoiser))

    def image_tokens(self, height: int, width: int) -> int:
        """A row's image tokens as the transformer pads them (the first tokens of its sequence)."""
        latent = self.vae_scale_factor * PATCH
        tokens = (height // latent) * (width // latent)
        return tokens + (-tokens) % SEQ_MULTIPLE

    # -- request mode: ONE pipeline call (one transformer forward per step, [pos ‖ neg] rows) -------------------
    def run_batch(self, requests: list[DiffusionRequest]) -> dict[str, np.ndarray]:
        s = requests[0].sampling
        self.cache_tokens = self.image_tokens(s.height, s.width)
        with self.batch_lora_rows(requests, cfg_rows=2 if s.guidance_scale > self.cfg_above else 1):
            return self.call_pipeline(requests, **self.prompt_kwargs(requests), cfg_truncation=self.cfg_truncation,
                                      cfg_normalization=self.cfg_normalization,
                                      max_sequence_length=MAX_SEQUENCE_LENGTH)

    # -- step contract ---------------------------------------------------------------------------------------
    def prepare_encode(self, request: DiffusionRequest) -> StepRequestState:
        s, pipe, n = request.sampling, self.pipe, request.sampling.num_outputs
        guided = s.guidance_scale > self.cfg_above
        embeds, negatives = pipe.encode_prompt(prompt=[request.prompt], device=self.device,
                                               do_classifier_free_guidance=guided,
                                               negative_prompt=[s.negative_prompt or ""],
                                               max_sequence_length=MAX_SEQUENCE_LENGTH)
        cond = {"embeds": embeds[0], **({"neg_embeds": negatives[0]} if guided else {})}
        latents = pipe.prepare_latents(n, pipe.transformer.in_channels, s.height, s.width, torch.float32,
                                       self.device, self.generators([request]))
        tokens = (latents.shape[2] // PATCH) * (latents.shape[3] // PATCH)
        scheduler = request_flow_scheduler(pipe.scheduler, s.num_inference_steps, self.device, tokens,
                                           ZIMAGE_MAX_SHIFT, get_default_z_image_sigmas(s.num_inference_steps))
        state = StepRequestState(request, scheduler, latents, do_cfg=False, cond=cond)
        state.do_cfg = self.guided_now(state)
        return state

    def guidance_now(self, state: StepRequestState) -> float:
        """The guidance scale of the state's current step: its own, or 0 past the CFG truncation."""
        scale = state.request.sampling.guidance_scale
        if scale > self.cfg_above and float(self.cfg_truncation) <= 1:
            if float((1000 - state.timestep.float()) / 1000) > self.cfg_truncation:
                return 0.0
        return scale

    def guided_now(self, state: StepRequestState) -> bool:
        """Whether the current step runs the negative rows (block_cache.step_rows reads ``do_cfg``)."""
        return self.guidance_now(state) > self.cfg_above

    def denoise_step(self, states: list[StepRequestState]) -> list[torch.Tensor]:
        dtype = self.pipe.transformer.dtype
        latents, timesteps, captions = [], [], []
        for st in states:
            n = len(st.latents)
            rows = list(st.latents.to(dtype).unsqueeze(2).unbind(0))
            branches = [st.cond["embeds"], st.cond["neg_embeds"]] if st.do_cfg else [st.cond["embeds"]]
            for caption in branches:
                latents += rows
                captions += [caption] * n
                timesteps.append((1000 - st.timestep.expand(n)) / 1000)
        s = states[0].request.sampling
        self.cache_tokens = self.image_tokens(s.height, s.width)
        with self.lora_rows("transformer", [(st.request, len(st.latents) * (2 if st.do_cfg else 1)) for st in states]):
            out = self.pipe.transformer(latents, torch.cat(timesteps), captions, return_dict=False)[0]
        preds, row = [], 0
        for st in states:
            n = len(st.latents)
            pos = out[row:row + n]
            negs = out[row + n:row + 2 * n] if st.do_cfg else None
            preds.append(self.guided_prediction(pos, negs, self.guidance_now(st)))
            row += 2 * n if st.do_cfg else n
        return preds

    def guided_prediction(self, pos: list[torch.Tensor], negs: list[torch.Tensor] | None,
                          scale: float) -> torch.Tensor:
        """(n, C, h, w): the velocity the scheduler steps with, from the rows' (C, 1, h, w) outputs, as
        ZImagePipeline computes it (per image, in float; normalised; negated)."""
        if negs is None:
            return -torch.stack([p.float() for p in pos]).squeeze(2)
        preds = []
        for p, q in zip(pos, negs, strict=True):
            p, q = p.float(), q.float()
            pred = p + scale * (p - q)
            if self.cfg_normalization and float(self.cfg_normalization) > 0.0:
                ceiling = torch.linalg.vector_norm(p) * float(self.cfg_normalization)
                norm = torch.linalg.vector_norm(pred)
                if norm > ceiling:
                    pred = pred * (ceiling / norm)
            preds.append(pred)
        return -torch.stack(preds).squeeze(2)

    def noise_step(self, state: StepRequestState, noise_pred: torch.Tensor) -> None:
        super().noise_step(state, noise_pred.to(torch.float32))
        if not state.finished:
            state.do_cfg = self.guided_now(state)

    def decode_latents(self, state: StepRequestState) -> torch.Tensor:
        return state.latents.to(self.pipe.vae.dtype)
