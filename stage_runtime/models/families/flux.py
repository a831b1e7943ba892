"""FLUX.1 pipelines (FluxPipeline): an MMDiT with double-stream then single-stream blocks, CLIP (pooled)
+ T5 (sequence) prompts, 2x2-packed latents with rotary position ids, flow matching with dynamic shift.

FLUX.1 [dev] is guidance-distilled: ``guidance_scale`` enters the transformer as an embedding (one value
per row) and there is no unconditional pass unless a request asks for true CFG (below). FLUX.1 [schnell] has
no guidance embedding at all (``guidance: none``; 4 steps). Ulysses shards the joint text+image sequence
(stage_runtime.distributed.ulysses_joint).

Compatibility: a denoiser forward needs one latent shape (height, width: image tokens, position ids)
and one text length (``max_sequence_length``, fixed per model); timesteps and guidance are per row, so
requests of different step counts and guidance scales share ticks. A pipeline call takes one step count,
one guidance scale and one true CFG scale.

Refusals (``PipelineAdapter.check_request``, by ``guidance``): a negative prompt without true CFG (diffusers'
FluxPipeline would ignore it; the message says to send ``true_cfg_scale > 1``) and, on [schnell], a guidance
scale (no guidance embedding: ignored).

Edits (img2img, inpainting): ``models.families.flux_edits``.

True CFG (``true_cfg_scale > 1`` with a negative prompt, as diffusers: ``stage_runtime.true_cfg`` refuses a
scale without a negative prompt, a negative prompt without the scale). diffusers calls the transformer twice
per step (prompt, then negative prompt: the same latents, timestep and guidance embedding) and combines
``neg + true_cfg_scale × (cond − neg)``. Here one step is ONE transformer forward over the rows of every
scheduled request, ``[cond × n; negative × n]`` for a request with true CFG, ``[cond × n]`` for one without
(they share ticks: the rows are per request). Request mode runs that step loop for a true-CFG wave (its
``request_key`` has ``true_cfg_scale``), so both modes make one denoiser call per step (the runner's step hook
counts steps); a wave without true CFG is one pipeline call as before. CFG-parallel splits the rows of each
forward, true CFG's halves included (the position ids are per token, never split).
"""

from __future__ import annotations

import numpy as np
import torch

from stage_runtime.distributed.ulysses_joint import enable_joint_sequence_parallel, joint_attention_heads
from stage_runtime.models.adapter import PipelineAdapter
from stage_runtime.models.flow_match import flux_sigmas, request_flow_scheduler
from stage_runtime.models.families.flux_edits import FluxEditMixin
from stage_runtime.models.step_contract import StepContract
from stage_runtime.models.step_state import StepRequestState
from stage_runtime.request import DiffusionRequest

T5_MAX_TOKENS = 512          # FluxPipeline's default (and limit) for max_sequence_length
FLUX_MAX_SHIFT = 1.15


class FluxAdapter(FluxEditMixin, StepContract, PipelineAdapter):
    pipeline_classes = ("FluxPipeline",)
    tiny_kinds = ("flux",)
    default_steps = 28
    default_guidance = 3.5
    guidance = "distilled"
    parallel_kinds = frozenset({"cfg", "ulysses", "ring", "tp"})
    sequence_parallel = staticmethod(enable_joint_sequence_parallel)   # the joint [text ‖ image] attention
    block_lists = ("transformer_blocks", "single_transformer_blocks")
    supports_block_cache = True          # models.block_cache: first block, then the rest or its residual
    lora_components = ("transformer", "text_encoder")      # as FluxPipeline.load_lora_weights (CLIP, not T5)
    request_key_fields = ("height", "width", "num_inference_steps", "guidance_scale", "true_cfg_scale")
    step_key_fields = ("height", "width")

    def __init__(self, pipeline, device):
        super().__init__(pipeline, device)
        if not self.pipe.transformer.config.guidance_embeds:      # FLUX.1 [schnell]
            self.guidance, self.default_guidance, self.default_steps = "none", 0.0, 4

    def num_attention_heads(self) -> int:             # FluxAttention: no diffusers Attention
        return joint_attention_heads(self.denoiser)

    def default_size(self) -> tuple[int, int]:
        side = self.pipe.vae.config.sample_size
        side = side[0] if isinstance(side, (list, tuple)) else side
        return int(side), int(side)

    def size_multiple(self) -> int:
        return self.vae_scale_factor * 2            # the VAE's factor, then 2x2 packing

    def max_sequence_length(self) -> int:
        return min(T5_MAX_TOKENS, int(self.pipe.tokenizer_2.model_max_length))

    def family_facts(self) -> dict:
        return {"true_cfg": True}                   # every FLUX.1 pipeline takes true_cfg_scale

    def enable_cfg_parallel(self, group) -> None:
        """Split the rows of every transformer call (true CFG's halves, then images) across ``group``; the position
        ids are per token and go whole to every rank."""
        from stage_runtime.distributed.cfg_parallel import enable_cfg_parallel

        enable_cfg_parallel(self.denoiser, group, per_token=("txt_ids", "img_ids"),
                            around_local=self.rows_on_this_rank(self.denoiser))

    # -- request mode ----------------------------------------------------------------------------------
    def run_batch(self, requests: list[DiffusionRequest]) -> dict[str, np.ndarray]:
        if requests[0].sampling.runs_true_cfg:           # diffusers makes two transformer calls a step: one here
            return self.run_step_loop(requests)
        with self.batch_lora_rows(requests):             # one row per image in both components
            if requests[0].edit is not None:              # img2img, inpaint (the same rows)
                return self.run_edit_batch(requests)
            return self.call_pipeline(requests, **self.prompt_kwargs(requests, negative=False),
                                      max_sequence_length=self.max_sequence_length())

    def encode_request_prompt(self, request: DiffusionRequest, text: str | None = None):
        """(T5 embeds [n, seq, d], pooled CLIP [n, d], text ids [seq, 3]) of the request's prompt (or ``text``: its
        negative prompt) for its n images, its LoRA rows set."""
        n = request.sampling.num_outputs
        with self.batch_lora_rows([request], components=self.encoder_lora_components):
            return self.pipe.encode_prompt(prompt=[request.prompt if text is None else text] * n, prompt_2=None,
                                           device=self.device, num_images_per_prompt=1,
                                           max_sequence_length=self.max_sequence_length())

    def prompt_conditioning(self, request: DiffusionRequest) -> dict[str, torch.Tensor]:
        """The step state's ``cond``: the prompt's embeds, pooled embeds and text ids, the negative prompt's
        (``neg_embeds``, ``neg_pooled``) under true CFG, the guidance embedding's value per row ([dev])."""
        s, n = request.sampling, request.sampling.num_outputs
        embeds, pooled, text_ids = self.encode_request_prompt(request)
        cond = {"embeds": embeds, "pooled": pooled, "text_ids": text_ids}
        if s.runs_true_cfg:            # the same text length (T5 pads to max_sequence_length): the same text ids
            cond["neg_embeds"], cond["neg_pooled"], _ = self.encode_request_prompt(request, s.negative_prompt)
        if self.pipe.transformer.config.guidance_embeds:
            cond["guidance"] = torch.full([n], s.guidance_scale, device=self.device, dtype=torch.float32)
        return cond

    # -- step contract: the same math as FluxPipeline.__call__, one step at a time -----------------------
    def prepare_encode(self, request: DiffusionRequest) -> StepRequestState:
        s, pipe, n = request.sampling, self.pipe, request.sampling.num_outputs
        cond = self.prompt_conditioning(request)
        channels = pipe.transformer.config.in_channels // 4
        latents, cond["image_ids"] = pipe.prepare_latents(n, channels, s.height, s.width, cond["embeds"].dtype,
                                                          self.device, self.generators([request]))
        scheduler = request_flow_scheduler(pipe.scheduler, s.num_inference_steps, self.device, latents.shape[1],
                                           FLUX_MAX_SHIFT, flux_sigmas(s.num_inference_steps, pipe.scheduler.config))
        state = StepRequestState(request, scheduler, latents, do_cfg=s.runs_true_cfg, cond=cond)
        if request.edit is not None:       # img2img, inpaint: latents from the image
            self.prepare_edit(request, state)
        return state

    def denoise_step(self, states: list[StepRequestState]) -> list[torch.Tensor]:
        """ONE transformer forward: each request's rows, ``[cond; negative]`` under true CFG, then guided."""
        rows, texts, pooled, timesteps, guidance = [], [], [], [], []
        for st in states:
            for embeds, pool in (("embeds", "pooled"), ("neg_embeds", "neg_pooled"))[:2 if st.do_cfg else 1]:
                rows.append(st.latents)
                texts.append(st.cond[embeds])
                pooled.append(st.cond[pool])
                timesteps.append(st.timestep.expand(len(st.latents)).to(st.latents.dtype))
                guidance.extend([st.cond["guidance"]] if "guidance" in st.cond else [])
        first = states[0].cond            # same size and text length: the position ids are shared
        with self.lora_rows("transformer", [(st.request, len(st.latents) * (2 if st.do_cfg else 1)) for st in states]):
            noise = self.pipe.transformer(
                hidden_states=torch.cat(rows), timestep=torch.cat(timesteps) / 1000,
                guidance=torch.cat(guidance) if guidance else None, pooled_projections=torch.cat(pooled),
                encoder_hidden_states=torch.cat(texts), txt_ids=first["text_ids"], img_ids=first["image_ids"],
                joint_attention_kwargs={}, return_dict=False)[0]
        preds, row = [], 0
        for st in states:
            n = len(st.latents)
            pred = noise[row:row + n]
            if st.do_cfg:                  # diffusers: neg + true_cfg_scale × (cond − neg)
                pred = self.guided(noise[row + n:row + 2 * n], pred, st.request.sampling.true_cfg_scale)
            preds.append(pred)
            row += 2 * n if st.do_cfg else n
        return preds

    def decode_latents(self, state: StepRequestState) -> torch.Tensor:
        s = state.request.sampling
        return self.pipe._unpack_latents(state.latents, s.height, s.width, self.pipe.vae_scale_factor)
