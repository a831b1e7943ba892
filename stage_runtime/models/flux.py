"""FLUX.1 pipelines (FluxPipeline): an MMDiT with double-stream then single-stream blocks, CLIP (pooled)
+ T5 (sequence) prompts, 2x2-packed latents with rotary position ids, flow matching with dynamic shift.

FLUX.1 [dev] is guidance-distilled: ``guidance_scale`` enters the transformer as an embedding (one value
per row) and there is no unconditional pass, hence no CFG-parallel. FLUX.1 [schnell] has no guidance
embedding at all (``guidance: none``; 4 steps). Ulysses shards the joint text+image sequence
(stage_runtime.distributed.ulysses_joint).

Compatibility: a denoiser forward needs one latent shape (height, width: image tokens, position ids)
and one text length (``max_sequence_length``, fixed per model); timesteps and guidance are per row, so
requests of different step counts and guidance scales share ticks. A pipeline call takes one step count
and one guidance scale.

Refusals (``PipelineAdapter.check_request``, by ``guidance``): a negative prompt (diffusers' FluxPipeline
uses one only for true CFG, ``true_cfg_scale > 1``, which is not served: it would be ignored) and, on
[schnell], a guidance scale (no guidance embedding: ignored).
"""

from __future__ import annotations

import numpy as np
import torch

from stage_runtime.models.adapter import PipelineAdapter
from stage_runtime.models.flow_match import flux_sigmas, request_flow_scheduler
from stage_runtime.models.flux_edit import FluxEditMixin
from stage_runtime.models.step_contract import StepContract
from stage_runtime.models.step_state import StepRequestState
from stage_runtime.request import DiffusionRequest

T5_MAX_TOKENS = 512          # FluxPipeline's default (and limit) for max_sequence_length
FLUX_MAX_SHIFT = 1.15


class FluxAdapter(FluxEditMixin, StepContract, PipelineAdapter):
    default_steps = 28
    default_guidance = 3.5
    guidance = "distilled"
    parallel_kinds = frozenset({"ulysses", "ring", "tp"})
    sequence_attention = "joint"
    block_lists = ("transformer_blocks", "single_transformer_blocks")
    supports_block_cache = True          # models.block_cache: first block, then the rest or its residual
    lora_components = ("transformer", "text_encoder")      # as FluxPipeline.load_lora_weights (CLIP, not T5)
    request_key_fields = ("height", "width", "num_inference_steps", "guidance_scale")
    step_key_fields = ("height", "width")

    def __init__(self, pipeline, device):
        super().__init__(pipeline, device)
        if not self.pipe.transformer.config.guidance_embeds:      # FLUX.1 [schnell]
            self.guidance, self.default_guidance, self.default_steps = "none", 0.0, 4

    @property
    def denoiser(self) -> torch.nn.Module:
        return self.pipe.transformer

    def default_size(self) -> tuple[int, int]:
        side = self.pipe.vae.config.sample_size
        side = side[0] if isinstance(side, (list, tuple)) else side
        return int(side), int(side)

    def size_multiple(self) -> int:
        return self.vae_scale_factor * 2            # the VAE's factor, then 2x2 packing

    def max_sequence_length(self) -> int:
        return min(T5_MAX_TOKENS, int(self.pipe.tokenizer_2.model_max_length))

    def parallel_refusal(self, kind: str) -> str | None:
        if kind == "cfg":
            return ("FLUX.1 is guidance-distilled: guidance_scale is an embedding inside the single transformer "
                    "pass of each step, there is no unconditional pass to put on another rank")
        return None

    # -- request mode ----------------------------------------------------------------------------------
    def run_batch(self, requests: list[DiffusionRequest]) -> dict[str, np.ndarray]:
        rows = [(r, r.sampling.num_outputs) for r in requests]     # LoRA: one row per image in both components
        with self.lora_rows("text_encoder", rows), self.lora_rows("transformer", rows):
            if requests[0].edit is not None:   # img2img: flux_edit (the same rows)
                return self.run_edit_batch(requests)
            return self._generate(requests)

    def _generate(self, requests: list[DiffusionRequest]) -> dict[str, np.ndarray]:
        s = requests[0].sampling           # key-compatible: size, steps and guidance are shared
        prompts = [r.prompt for r in requests for _ in range(r.sampling.num_outputs)]
        images = self.pipe(prompt=prompts, height=s.height, width=s.width, num_inference_steps=s.num_inference_steps,
                           guidance_scale=s.guidance_scale, generator=self.generators(requests),
                           max_sequence_length=self.max_sequence_length(), output_type="np", return_dict=False)[0]
        return self.split_images(requests, images)

    def encode_request_prompt(self, request: DiffusionRequest):
        """(T5 embeds [n, seq, d], pooled CLIP [n, d], text ids [seq, 3]) for the request's n images, its LoRA rows set."""
        n = request.sampling.num_outputs
        with self.lora_rows("text_encoder", [(request, n)]):
            return self.pipe.encode_prompt(prompt=[request.prompt] * n, prompt_2=None, device=self.device,
                                           num_images_per_prompt=1, max_sequence_length=self.max_sequence_length())

    # -- step contract: the same math as FluxPipeline.__call__, one step at a time -----------------------
    def prepare_encode(self, request: DiffusionRequest) -> StepRequestState:
        s, pipe, n = request.sampling, self.pipe, request.sampling.num_outputs
        embeds, pooled, text_ids = self.encode_request_prompt(request)
        channels = pipe.transformer.config.in_channels // 4
        latents, image_ids = pipe.prepare_latents(n, channels, s.height, s.width, embeds.dtype, self.device,
                                                  self.generators([request]))
        scheduler = request_flow_scheduler(pipe.scheduler, s.num_inference_steps, self.device, latents.shape[1],
                                           FLUX_MAX_SHIFT, flux_sigmas(s.num_inference_steps, pipe.scheduler.config))
        cond = {"embeds": embeds, "pooled": pooled, "text_ids": text_ids, "image_ids": image_ids}
        if pipe.transformer.config.guidance_embeds:
            cond["guidance"] = torch.full([n], s.guidance_scale, device=self.device, dtype=torch.float32)
        state = StepRequestState(request, scheduler, latents, do_cfg=False, cond=cond)
        if request.edit is not None:       # img2img: latents from the image (flux_edit)
            self.prepare_edit(request, state)
        return state

    def denoise_step(self, states: list[StepRequestState]) -> list[torch.Tensor]:
        rows = [st.latents for st in states]
        timesteps = torch.cat([st.timestep.expand(len(st.latents)).to(st.latents.dtype) for st in states])
        guidance = (torch.cat([st.cond["guidance"] for st in states]) if "guidance" in states[0].cond else None)
        first = states[0].cond            # same size and text length: the position ids are shared
        with self.lora_rows("transformer", [(st.request, len(st.latents)) for st in states]):
            noise = self.pipe.transformer(
                hidden_states=torch.cat(rows), timestep=timesteps / 1000, guidance=guidance,
                pooled_projections=torch.cat([st.cond["pooled"] for st in states]),
                encoder_hidden_states=torch.cat([st.cond["embeds"] for st in states]),
                txt_ids=first["text_ids"], img_ids=first["image_ids"], joint_attention_kwargs={},
                return_dict=False)[0]
        return self.split_rows(noise, rows)

    def post_decode(self, state: StepRequestState) -> np.ndarray:
        pipe, s = self.pipe, state.request.sampling
        latents = pipe._unpack_latents(state.latents, s.height, s.width, pipe.vae_scale_factor)
        latents = latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        image = pipe.vae.decode(latents, return_dict=False)[0]
        return self.to_uint8(pipe.image_processor.postprocess(image, output_type="np"))
