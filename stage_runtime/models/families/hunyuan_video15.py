"""HunyuanVideo-1.5 text-to-video (HunyuanVideo15Pipeline).

A dual-stream 3-D DiT over video latents concatenated with zero image-conditioning latents and a zero mask
(T2V), two prompt encoders, flow matching, and guidance by the pipeline's ``guider`` component:

    Qwen2.5-VL  the prompt in the pipeline's chat template (a system message), the hidden states of the third
                layer from the end, the first 108 tokens (system message and user header) cropped, 1000 kept
    ByT5        only the quoted text of the prompt ("..." or “...”) as ``Text "...". `` (256 bytes); no quotes:
                zero embeddings and a zero mask
    image       729 zero tokens, masked out (T2V)
    guider      ``ClassifierFreeGuidance``: ``__call__`` has no ``guidance_scale``; the folder's guider gives the
                default scale and the rest (``guidance_rescale``, ``use_original_formulation``, the
                ``start``/``stop`` window of steps, ``enabled``); CFG is off at scale 1 (0 with the original
                formulation) and outside the window: one transformer row per video then, two inside it

diffusers runs the transformer once per guider batch (cond, then uncond). Here one step is ONE denoiser forward
over every scheduled request's rows, ``[cond x n; uncond x n]`` on the steps its guider guides and ``[cond x n]``
on the others, each request with its own guider copy at its guidance scale (``guider.set_state`` per step,
``guider.forward`` on its rows, exactly the pipeline's combination); request mode runs that step loop to the end
for its wave (as Wan). Timesteps, guidance and the ByT5 mask are per row, so requests of different step counts,
guidance scales and glyph texts share ticks.

Frames are ``4k + 1`` (the VAE's temporal factor; diffusers silently makes ``4 ((F - 1) // 4) + 1``): any other
count is refused at admission. Height and width are multiples of the VAE's spatial factor x the patch size (16
for the real model, 4 for the tiny one; diffusers does not check and makes a smaller video). The default size
is the pipeline's 16:9 bucket nearest ``transformer.config.target_size`` (848x480 at 480p), 121 frames, 24 fps.
Parallel: CFG parallel splits the rows of each forward (latents, per-row timesteps, both encoders' states and
masks, image tokens) like any denoiser's; Ulysses, ring and both cut the video and context tokens of every block
(the installer below); tensor parallel is refused at load (exit 2, naming why).
diffusers 0.42.1's VAE cannot decode more than one video at once (its causal attention mask does not broadcast
over a batch): each video is decoded alone, as ``vae.enable_slicing()`` does.

Sequence parallelism (Ulysses, ring, Ulysses × ring) for HunyuanVideo-1.5's dual-stream video DiT
(``HunyuanVideo15Transformer3DModel``), over the shared distributed.usp.SequenceMesh.

Each block attends over the JOINT sequence ``[video ‖ context]``: the context is the model's reordered
``[valid image, valid ByT5, valid Qwen ‖ padding]`` tokens (1985 a row: 729 + 256 + 1000) with its mask
(T2V: the image tokens masked out). diffusers' ``HunyuanVideo15AttnProcessor2_0`` masks keys AND queries
(``mask_1 & mask_2``): a padded context token attends to nothing (SDPA gives it zeros) and no token attends
to it. Modulation (per row), norms and MLPs are token-local, so both streams are cut across the P ranks of
the sp group (``torch.tensor_split``: chunks may be uneven, 1985 never splits evenly)::

    transformer_blocks[0] pre-hook   video (B, S, C) → my chunk; context (B, T, C) and its mask (B, T) → my
                                     chunk; the rotary tables (S, D) → my rows (the mask and the rows for
                                     every later block: blocks are called positionally, so by position)
    joint attention (processor)      q, k, v of [my video ‖ my context] (q/k RMS-normed per head, rotary on
                                     the video) → mesh.attention (Ulysses inside, ring across) over every
                                     rank's tokens with the key mask [video: all ‖ context: its mask] of every
                                     rank, in sp-rank order → my padded context queries zeroed (as SDPA's
                                     fully masked rows) → to_out (video), to_add_out (context)
    proj_out forward hook            my video tokens → all_gather → (B, S, c): the unpatchify sees every token

So every token's state is the unsharded one, padded context tokens included. The token refiner (the Qwen
text's own self-attention) runs before the first block, whole on every rank. A call with fewer video or
context tokens than sp ranks runs unsharded on every rank, through the model's own processor. The hooks,
the shard state and validate-then-install are distributed/sequence_shard.py's.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stage_runtime.distributed import sequence_shard
from stage_runtime.distributed.sequence_shard import Shard, ShardState, Sharded, check_ulysses_heads
from stage_runtime.distributed.ulysses_joint import chunk_sizes, joint_projections
from stage_runtime.distributed.usp import SequenceMesh
from stage_runtime.errors import ConfigError, ModelLoadError
from stage_runtime.models.adapter import PipelineAdapter
from stage_runtime.models.step_contract import StepContract
from stage_runtime.models.step_state import StepRequestState
from stage_runtime.request import DiffusionRequest

DEFAULT_FPS = 24                   # HunyuanVideo-1.5 makes 24 fps video (121 frames: 5 s)
DEFAULT_ASPECT = (16, 9)           # (width, height): HunyuanVideo15Pipeline's default_aspect_ratio
DEFAULT_GUIDANCE = 6.0             # the real checkpoints' guider scale (a folder's own guider overrides it)


# -- sequence parallelism: the installer of the adapter's ``sequence_parallel`` (see the module docstring) ------------
_TRANSFORMER = "HunyuanVideo15Transformer3DModel"
_PROCESSOR = "HunyuanVideo15AttnProcessor2_0"
# HunyuanVideo15TransformerBlock.forward, as the transformer calls it (positionally)
_BLOCK_ARGS = ("hidden_states", "encoder_hidden_states", "temb", "attention_mask", "freqs_cis")
_STREAMS = (0, 1, "hidden_states", "encoder_hidden_states")     # flow from block to block: not overridden


class HunyuanVideo15UlyssesAttnProcessor:
    """The joint attention of one HunyuanVideo-1.5 block from my chunk of each stream (see the module
    docstring); unsharded calls go to the model's own processor."""

    def __init__(self, mesh: SequenceMesh, state: ShardState, original):
        self.mesh, self.state, self.original = mesh, state, original

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None):
        shard = self.state.shard
        if shard is None:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        if encoder_hidden_states is None or attention_mask is None or \
                tuple(attention_mask.shape) != tuple(encoder_hidden_states.shape[:2]):
            raise RuntimeError("HunyuanVideo-1.5 sequence parallel: the sharded attention needs the context tokens "
                               "and their mask, of one length")
        from diffusers.models.embeddings import apply_rotary_emb

        video, context = joint_projections(attn, hidden_states, encoder_hidden_states)
        if image_rotary_emb is not None:                      # my rows of the tables (the split rule's)
            video[0], video[1] = (apply_rotary_emb(t, image_rotary_emb, sequence_dim=1) for t in video[:2])
        query, key, value = (torch.cat([v, c], dim=1) for v, c in zip(video, context, strict=True))
        counts = [v + c for v, c in zip(shard.image, shard.text, strict=True)]
        out = self.mesh.attention(query, key, value, counts, shard.key_mask)          # (B, S_s, H, D)
        tokens = hidden_states.shape[1]
        padded = ~attention_mask.bool()[:, :, None, None]    # the query mask: fully masked rows give zeros
        out = torch.cat([out[:, :tokens], out[:, tokens:].masked_fill(padded, 0.0)], dim=1)
        out = out.flatten(2, 3).to(query.dtype)
        video_out = attn.to_out[1](attn.to_out[0](out[:, :tokens].contiguous()))
        return video_out, attn.to_add_out(out[:, tokens:].contiguous())


def split_hunyuan(mesh: SequenceMesh, args: tuple, kwargs: dict) -> Shard | None:
    """The split rule of a block's call (positional, as the transformer makes it, or keywords): my chunk of the
    video and context tokens, my chunk of the context mask and my rows of the rotary tables (these two for
    every later block too), and the key mask over every rank's [video ‖ context] tokens. None (unsharded)
    when a stream has fewer tokens than sp ranks."""
    call = {**dict(zip(_BLOCK_ARGS, args)), **kwargs}
    video, context, mask = call["hidden_states"], call["encoder_hidden_states"], call.get("attention_mask")
    if mask is None:
        raise RuntimeError("HunyuanVideo-1.5 sequence parallel: a block was called without its context mask")
    degree, rank = mesh.sp_size, mesh.sp_rank
    if min(video.shape[1], context.shape[1]) < degree:
        return None

    def mine(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return torch.tensor_split(t, degree, dim=dim)[rank]

    masks = torch.tensor_split(mask.bool(), degree, dim=1)
    video_counts = chunk_sizes(video.shape[1], degree)
    local = {"hidden_states": mine(video), "encoder_hidden_states": mine(context), "attention_mask": masks[rank]}
    if call.get("freqs_cis") is not None:
        local["freqs_cis"] = tuple(mine(table, dim=0) for table in call["freqs_cis"])
    where = {name: i for i, name in enumerate(_BLOCK_ARGS[:len(args)])}      # positional: by index
    changes = {where.get(name, name): value for name, value in local.items()}
    key_mask = torch.cat([part for m, n in zip(masks, video_counts, strict=True)
                          for part in (m.new_ones((m.shape[0], n)), m)], dim=1)
    return Shard(*sequence_shard.override(args, kwargs, changes), image=video_counts,
                 text=chunk_sizes(context.shape[1], degree),
                 later={key: value for key, value in changes.items() if key not in _STREAMS}, key_mask=key_mask)


def enable_hunyuan_video15_sequence_parallel(transformer: torch.nn.Module, ulysses_degree: int, make_mesh) -> None:
    """Shard both token streams of every block of a HunyuanVideo15Transformer3DModel over the mesh
    ``make_mesh()`` builds once everything is validated (ConfigError where it cannot: another transformer, a
    processor other than diffusers' HunyuanVideo15AttnProcessor2_0, fused projections, heads
    ``ulysses_degree`` does not divide)."""
    sequence_shard.install(transformer, make_mesh, lambda: [_plan(transformer, ulysses_degree)])


def _plan(transformer: torch.nn.Module, degree: int) -> Sharded:
    name = type(transformer).__name__
    blocks = list(getattr(transformer, "transformer_blocks", ()))
    if name != _TRANSFORMER or not blocks:
        raise ConfigError(f"HunyuanVideo-1.5 sequence parallel: {name} is not a {_TRANSFORMER} with transformer_blocks")
    for i, block in enumerate(blocks):
        attn, where = block.attn, f"{name}.transformer_blocks.{i}.attn"
        if type(attn.processor).__name__ != _PROCESSOR:
            raise ConfigError(f"HunyuanVideo-1.5 sequence parallel: {where} uses {type(attn.processor).__name__}; "
                              f"only diffusers' {_PROCESSOR} is sharded")
        if getattr(attn, "fused_projections", False):
            raise ConfigError(f"HunyuanVideo-1.5 sequence parallel: {where} has fused q/k/v projections, which it "
                              "does not implement")
        check_ulysses_heads(attn.heads, degree)
    return Sharded(name, blocks, transformer.proj_out, [block.attn for block in blocks],
                   lambda mesh, state, attn: HunyuanVideo15UlyssesAttnProcessor(mesh, state, attn.processor),
                   split_hunyuan)


# -- the family -------------------------------------------------------------------------------------------------------
@dataclass
class HunyuanStepState(StepRequestState):
    """A step state with the request's own guider copy (its scale, the folder's other settings, its step)."""

    guider: Any = None


class HunyuanVideo15Adapter(StepContract, PipelineAdapter):
    pipeline_classes = ("HunyuanVideo15Pipeline",)
    tiny_kinds = ("hunyuan-video15",)
    refuses_long_prompts = True          # a prompt the Qwen encoder would cut is a 400 (engine/prompt_length)
    default_steps = 50
    default_guidance = DEFAULT_GUIDANCE
    parallel_kinds = frozenset({"cfg", "ulysses", "ring"})
    sequence_parallel = staticmethod(enable_hunyuan_video15_sequence_parallel)  # joint [video ‖ context], its mask
    # Guidance (each request's guider copy) and text masks are per row in either mode; a request-mode wave shares
    # its step count (one step loop), step mode not even that.
    request_key_fields = ("height", "width", "num_frames", "num_inference_steps")
    step_key_fields = ("height", "width", "num_frames")

    def __init__(self, pipeline, device: torch.device):
        super().__init__(pipeline, device)
        from diffusers.guiders import ClassifierFreeGuidance

        if not isinstance(pipeline.guider, ClassifierFreeGuidance):
            raise ModelLoadError(f"guider={type(pipeline.guider).__name__}: HunyuanVideo15Pipeline is served with a "
                                 "ClassifierFreeGuidance guider only (the class its pipeline declares)")
        self.default_guidance = float(pipeline.guider.guidance_scale)

    def parallel_refusal(self, kind: str) -> str | None:
        if kind == "tp":
            return ("distributed/tensor_parallel.py shards attentions that run diffusers' DiT/SD, SD3 and FLUX.1 "
                    "processors, and the blocks' HunyuanVideo15AttnProcessor2_0 (joint attention with the context "
                    "mask) is not one of them")
        return None

    @property
    def vae_scale_factor(self) -> int:
        return int(self.pipe.vae_scale_factor_spatial)

    def size_multiple(self) -> int:
        return self.vae_scale_factor * int(self.pipe.transformer.config.patch_size)

    def default_size(self) -> tuple[int, int]:
        """The pipeline's own default: the 16:9 bucket nearest the transformer's ``target_size``."""
        width, height = getattr(self.pipe, "default_aspect_ratio", DEFAULT_ASPECT)   # I2V has none: T2V's
        h, w = self.pipe.video_processor.calculate_default_height_width(height, width, self.pipe.target_size)
        return int(h), int(w)

    def max_sequence_length(self) -> int:
        return int(self.pipe.tokenizer_max_length)

    def family_facts(self) -> dict:
        frames = inspect.signature(type(self.pipe).__call__).parameters["num_frames"].default
        return {"frame_rule": (int(self.pipe.vae_scale_factor_temporal), 1), "default_frames": int(frames),
                "default_fps": DEFAULT_FPS}

    # -- request mode: the step loop, to the end, for the whole wave -------------------------------------
    def run_batch(self, requests: list[DiffusionRequest]) -> dict[str, np.ndarray]:
        return self.run_step_loop(requests)

    # -- step contract: HunyuanVideo15Pipeline.__call__, one step at a time -------------------------------
    def request_guider(self, guidance_scale: float):
        """The request's own copy of the folder's guider, at its scale (the guider keeps per-step state)."""
        guider = copy.deepcopy(self.pipe.guider)
        guider.guidance_scale = guidance_scale
        return guider

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Both encoders' embeddings and masks for ``prompts`` (the pipeline's ``encode_prompt``)."""
        embeds, mask, embeds_2, mask_2 = self.pipe.encode_prompt(
            prompt=prompts, device=self.device, dtype=self.pipe.transformer.dtype, batch_size=len(prompts))
        return {"encoder_hidden_states": embeds, "encoder_attention_mask": mask,
                "encoder_hidden_states_2": embeds_2, "encoder_attention_mask_2": mask_2}

    def prepare_encode(self, request: DiffusionRequest) -> HunyuanStepState:
        s, pipe, n = request.sampling, self.pipe, request.sampling.num_outputs
        guider = self.request_guider(s.guidance_scale)
        cond = {f"cond_{k}": v for k, v in self.encode([request.prompt] * n).items()}
        if guider._enabled and guider.num_conditions > 1:      # a fresh guider: CFG on at some step
            cond.update({f"uncond_{k}": v for k, v in self.encode([s.negative_prompt or ""] * n).items()})
        dtype = pipe.transformer.dtype
        latents = pipe.prepare_latents(n, pipe.num_channels_latents, s.height, s.width, s.num_frames, dtype,
                                       self.device, self.generators([request]))
        scheduler = copy.deepcopy(pipe.scheduler)
        sigmas = np.linspace(1.0, 0.0, s.num_inference_steps + 1)[:-1]
        scheduler.set_timesteps(sigmas=sigmas, device=self.device)
        scheduler.set_begin_index(0)
        return HunyuanStepState(request, scheduler, latents, do_cfg=bool(guider.num_conditions > 1), cond=cond,
                                guider=guider)

    def guided_now(self, state: HunyuanStepState) -> bool:
        """Set the request's guider to this step (as the pipeline does); True when it guides it (two rows)."""
        state.guider.set_state(step=state.step_index, num_inference_steps=state.total_steps, timestep=state.timestep)
        return state.guider.num_conditions > 1

    def denoise_step(self, states: list[HunyuanStepState]) -> list[torch.Tensor]:
        dtype = self.pipe.transformer.dtype
        branches = [("cond", "uncond") if self.guided_now(st) else ("cond",) for st in states]
        rows, timesteps, images, text = [], [], [], {}
        for st, names in zip(states, branches, strict=True):
            row = torch.cat([self.model_input(st, st.latents.to(dtype))] * len(names))
            rows.append(row)
            timesteps.append(st.timestep.expand(len(row)).to(dtype))
            images.append(torch.cat([self.image_tokens(st)] * len(names)))
            for key in ("encoder_hidden_states", "encoder_attention_mask", "encoder_hidden_states_2",
                        "encoder_attention_mask_2"):
                text.setdefault(key, []).extend(st.cond[f"{name}_{key}"] for name in names)
        noise = self.denoiser(hidden_states=torch.cat(rows), image_embeds=torch.cat(images),
                              timestep=torch.cat(timesteps), **self.more_inputs(states, branches),
                              **{key: torch.cat(parts) for key, parts in text.items()}, return_dict=False)[0]
        preds = []
        for st, names, pred in zip(states, branches, self.split_rows(noise, rows), strict=True):
            preds.append(st.guider.forward(*pred.chunk(len(names))).pred)     # (pred_cond[, pred_uncond])
        return preds

    def model_input(self, state: HunyuanStepState, latents: torch.Tensor) -> torch.Tensor:
        """One state's rows of ``hidden_states``: [latents ‖ conditioning latents ‖ mask], both zero (T2V)."""
        zeros = torch.zeros_like(latents)
        return torch.cat([latents, zeros, zeros[:, :1]], dim=1)

    def image_tokens(self, state: HunyuanStepState) -> torch.Tensor:
        """One state's rows of ``image_embeds``: 729 zero tokens (T2V: the transformer masks them out)."""
        n = len(state.latents)
        return torch.zeros(n, self.pipe.vision_num_semantic_tokens, self.pipe.vision_states_dim,
                           dtype=self.pipe.transformer.dtype, device=state.latents.device)

    def more_inputs(self, states: list[HunyuanStepState], branches: list[tuple[str, ...]]) -> dict[str, torch.Tensor]:
        """More keyword inputs of the forward, per row (none for T2V: its ``__call__`` passes no ``timestep_r``)."""
        return {}

    def post_decode(self, state: StepRequestState) -> np.ndarray:
        """uint8 (num_outputs, F, H, W, 3): latents / scaling_factor, decoded one video at a time."""
        vae = self.pipe.vae
        latents = state.latents.to(vae.dtype) / vae.config.scaling_factor
        video = torch.cat([vae.decode(z, return_dict=False)[0] for z in latents.split(1)])
        return self.to_uint8(self.pipe.video_processor.postprocess_video(video, output_type="np"))
