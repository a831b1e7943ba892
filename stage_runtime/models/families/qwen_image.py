"""Qwen-Image (QwenImagePipeline): a dual-stream MMDiT over packed 2x2 latent patches, a Qwen2.5-VL text
encoder (prompt in a chat template, the template's system prefix dropped), flow matching with a dynamic
shift, and *true* CFG: the request's ``guidance_scale`` is diffusers' ``true_cfg_scale``.

diffusers calls the transformer twice per step (prompt, then negative prompt) and rescales the guided
prediction to the conditional one's norm. Here one step is ONE transformer forward over the rows of
every scheduled request, for each ``[cond x n; negative x n]`` when guided::

    rows        latents (n, L, 4C) twice, text embeds padded to the longest prompt of the tick (with a
                key mask; no mask when every row is full), timestep t / 1000 per row
    guided      comb = neg + s * (cond - neg);  pred = comb * |cond| / |comb|   (norms over channels)

Request mode runs the same loop to the end for the wave (requests of a wave share size and steps), so
both modes make one denoiser call per step — the runner's step hook counts steps — and CFG-parallel
splits true-CFG rows like any other rows. Without a negative prompt true CFG uses ``" "`` (Qwen-Image's
own usage; diffusers enables it only when a negative prompt is given). Guidance <= 1 runs unguided.

LoRA adapts the transformer (QwenImageLoraLoaderMixin; the Qwen2.5-VL encoder never): each request's rows
(prompt and negative alike) carry its adapters.

Sequence parallelism (Ulysses, ring, Ulysses × ring) for Qwen-Image's dual-stream MMDiT
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

import numpy as np
import torch
from diffusers.models.attention_processor import Attention

from stage_runtime.distributed import sequence_shard
from stage_runtime.distributed.sequence_shard import Shard, ShardState, Sharded, check_ulysses_heads
from stage_runtime.distributed.ulysses_joint import joint_projections, split_streams
from stage_runtime.distributed.usp import SequenceMesh
from stage_runtime.errors import ConfigError
from stage_runtime.models.adapter import PipelineAdapter
from stage_runtime.models.flow_match import request_flow_scheduler
from stage_runtime.models.step_contract import StepContract
from stage_runtime.models.step_state import StepRequestState
from stage_runtime.request import DiffusionRequest

DEFAULT_NEGATIVE = " "
MAX_SEQUENCE_LENGTH = 512          # QwenImagePipeline.__call__'s default
QWEN_MAX_SHIFT = 1.15              # the dynamic shift's default top (QwenImagePipeline's calculate_shift)


# -- sequence parallelism: the installer of the adapter's ``sequence_parallel`` (see the module docstring) ------------
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


# -- the family -------------------------------------------------------------------------------------------------------
class QwenImageAdapter(StepContract, PipelineAdapter):
    pipeline_classes = ("QwenImagePipeline",)
    tiny_kinds = ("qwen-image",)
    guidance = "true_cfg"                                          # guidance_scale is true_cfg_scale
    default_steps, default_guidance = 50, 4.0
    block_lists = ("transformer_blocks",)                          # the dual-stream MMDiT blocks
    parallel_kinds = frozenset({"cfg", "ulysses", "ring"})
    sequence_parallel = staticmethod(enable_qwen_sequence_parallel)  # both streams cut, the text key mask (above)
    lora_components = ("transformer",)                             # as QwenImageLoraLoaderMixin

    @property
    def supports_block_cache(self) -> bool:        # zero_cond_t doubles the modulation rows: not per-row
        return not getattr(self.pipe.transformer.config, "zero_cond_t", False)

    @property
    def vae_scale_factor(self) -> int:
        return int(self.pipe.vae_scale_factor)

    def size_multiple(self) -> int:
        return self.vae_scale_factor * 2            # latent pixels pack 2x2 into one token

    def default_size(self) -> tuple[int, int]:
        side = self.pipe.default_sample_size * self.vae_scale_factor
        return side, side

    def max_sequence_length(self) -> int:
        return MAX_SEQUENCE_LENGTH

    # -- request mode: the step loop, to the end, for the whole wave -------------------------------------
    def run_batch(self, requests: list[DiffusionRequest]) -> dict[str, np.ndarray]:
        return self.run_step_loop(requests)

    # -- step contract -------------------------------------------------------------------------------------
    def _encode(self, text: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, T, D) embeddings of the templated text and their (n, T) validity mask (all ones: one prompt)."""
        embeds, mask = self.pipe.encode_prompt(prompt=[text], device=self.device, num_images_per_prompt=n,
                                               max_sequence_length=MAX_SEQUENCE_LENGTH)
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return embeds, mask

    def prepare_encode(self, request: DiffusionRequest) -> StepRequestState:
        s, pipe, n = request.sampling, self.pipe, request.sampling.num_outputs
        do_cfg = s.guidance_scale > 1
        embeds, mask = self._encode(request.prompt, n)
        cond = {"embeds": embeds, "mask": mask}
        if do_cfg:
            negative = s.negative_prompt if s.negative_prompt is not None else DEFAULT_NEGATIVE
            cond["neg_embeds"], cond["neg_mask"] = self._encode(negative, n)
        latents = pipe.prepare_latents(n, pipe.transformer.config.in_channels // 4, s.height, s.width, embeds.dtype,
                                       self.device, self.generators([request]))
        scheduler = request_flow_scheduler(pipe.scheduler, s.num_inference_steps, self.device, latents.shape[1],
                                           QWEN_MAX_SHIFT, np.linspace(1.0, 1 / s.num_inference_steps,
                                                                       s.num_inference_steps))
        return StepRequestState(request, scheduler, latents, do_cfg, cond=cond)

    def latent_grid(self, state: StepRequestState) -> tuple[int, int, int]:
        """(frames, rows, columns) of packed tokens: the transformer's ``img_shapes`` entry."""
        s, factor = state.request.sampling, self.vae_scale_factor
        return 1, s.height // factor // 2, s.width // factor // 2

    def denoise_step(self, states: list[StepRequestState]) -> list[torch.Tensor]:
        latents, texts, masks, timesteps = [], [], [], []
        for st in states:
            branches = [("embeds", "mask"), ("neg_embeds", "neg_mask")] if st.do_cfg else [("embeds", "mask")]
            for embeds, mask in branches:
                latents.append(st.latents)
                texts.append(st.cond[embeds])
                masks.append(st.cond[mask])
                timesteps.append(st.timestep.reshape(1).expand(len(st.latents)))
        longest = max(t.shape[1] for t in texts)
        text = torch.cat([torch.nn.functional.pad(t, (0, 0, 0, longest - t.shape[1])) for t in texts])
        mask = torch.cat([torch.nn.functional.pad(m, (0, longest - m.shape[1])) for m in masks])
        hidden = torch.cat(latents)
        rows = [(st.request, len(st.latents) * (2 if st.do_cfg else 1)) for st in states]
        with self.lora_rows("transformer", rows):
            noise = self.pipe.transformer(
                hidden_states=hidden, timestep=torch.cat(timesteps).to(hidden.dtype) / 1000,
                encoder_hidden_states=text, encoder_hidden_states_mask=None if bool(mask.all()) else mask,
                img_shapes=[[self.latent_grid(states[0])]] * len(hidden), return_dict=False)[0]
        preds, row = [], 0
        for st in states:
            n = len(st.latents)
            pred = noise[row:row + n]
            if st.do_cfg:
                neg = noise[row + n:row + 2 * n]
                comb = neg + st.request.sampling.guidance_scale * (pred - neg)
                pred = comb * (torch.norm(pred, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
            preds.append(pred)
            row += 2 * n if st.do_cfg else n
        return preds

    def post_decode(self, state: StepRequestState) -> np.ndarray:
        vae = self.pipe.vae
        _, rows, cols = self.latent_grid(state)
        n, _, channels = state.latents.shape
        latents = state.latents.view(n, rows, cols, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
        latents = latents.reshape(n, channels // 4, 1, rows * 2, cols * 2).to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean, device=latents.device, dtype=latents.dtype).view(shape)
        std = torch.tensor(vae.config.latents_std, device=latents.device, dtype=latents.dtype).view(shape)
        image = vae.decode(latents / (1.0 / std) + mean, return_dict=False)[0][:, :, 0]   # as diffusers scales
        return self.to_uint8(self.pipe.image_processor.postprocess(image, output_type="np"))
