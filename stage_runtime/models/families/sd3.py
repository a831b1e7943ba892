"""Stable Diffusion 3 / 3.5 pipelines (StableDiffusion3Pipeline): an MMDiT over [image ‖ text] tokens, two
CLIP text encoders (penultimate hidden states + pooled projections) and T5, flow matching (static shift,
or dynamic when the scheduler says so), classifier-free guidance with [uncond; cond] rows.

Compatibility: a denoiser forward needs one latent shape (height, width) and one text length (77 CLIP +
``max_sequence_length`` T5 tokens, fixed per model); CFG rows, timesteps and guidance are per request,
so requests of different step counts and guidance scales share ticks. A pipeline call takes one step
count and one guidance scale. CFG-parallel splits the rows of each forward; Ulysses shards the joint
sequence (stage_runtime.distributed.ulysses_joint).
"""

from __future__ import annotations

import numpy as np
import torch

from stage_runtime.distributed.ulysses_joint import enable_joint_sequence_parallel, joint_attention_heads
from stage_runtime.models.adapter import PipelineAdapter
from stage_runtime.models.flow_match import request_flow_scheduler
from stage_runtime.models.step_contract import StepContract
from stage_runtime.models.step_state import StepRequestState
from stage_runtime.request import DiffusionRequest

T5_MAX_TOKENS = 256          # StableDiffusion3Pipeline's default max_sequence_length
SD3_MAX_SHIFT = 1.16


class StableDiffusion3Adapter(StepContract, PipelineAdapter):
    pipeline_classes = ("StableDiffusion3Pipeline",)
    tiny_kinds = ("sd3",)
    default_steps = 28
    default_guidance = 7.0
    parallel_kinds = frozenset({"cfg", "ulysses", "ring", "tp"})
    sequence_parallel = staticmethod(enable_joint_sequence_parallel)   # the joint [image ‖ text] attention
    block_lists = ("transformer_blocks",)
    supports_block_cache = True          # models.block_cache: first block, then the rest or its residual
    compile_blocks = ("JointTransformerBlock",)   # SD3Transformer2DModel declares no _repeated_blocks
    lora_components = ("transformer", "text_encoder", "text_encoder_2")   # as SD3LoraLoaderMixin (not T5)
    request_key_fields = ("height", "width", "num_inference_steps", "guidance_scale")
    step_key_fields = ("height", "width")

    def num_attention_heads(self) -> int:             # of every joint attention
        return joint_attention_heads(self.denoiser)

    def size_multiple(self) -> int:
        return self.vae_scale_factor * self.pipe.transformer.config.patch_size

    def max_sequence_length(self) -> int:
        t5 = self.pipe.tokenizer_3
        return T5_MAX_TOKENS if t5 is None else min(T5_MAX_TOKENS, int(t5.model_max_length))

    # -- request mode ----------------------------------------------------------------------------------
    def run_batch(self, requests: list[DiffusionRequest]) -> dict[str, np.ndarray]:
        with self.batch_lora_rows(requests, cfg_rows=2 if requests[0].sampling.guidance_scale > 1 else 1):
            return self.call_pipeline(requests, **self.prompt_kwargs(requests),
                                      max_sequence_length=self.max_sequence_length())

    # -- step contract: the same math as StableDiffusion3Pipeline.__call__, one step at a time -----------
    def prepare_encode(self, request: DiffusionRequest) -> StepRequestState:
        s, pipe, n = request.sampling, self.pipe, request.sampling.num_outputs
        do_cfg = s.guidance_scale > 1
        with self.batch_lora_rows([request], components=self.encoder_lora_components):
            embeds, negative, pooled, negative_pooled = pipe.encode_prompt(
                prompt=[request.prompt] * n, prompt_2=None, prompt_3=None, device=self.device,
                num_images_per_prompt=1, do_classifier_free_guidance=do_cfg,
                negative_prompt=[s.negative_prompt or ""] * n, max_sequence_length=self.max_sequence_length())
        if do_cfg:                          # SD3's row order: unconditional first
            embeds, pooled = torch.cat([negative, embeds]), torch.cat([negative_pooled, pooled])
        latents = pipe.prepare_latents(n, pipe.transformer.config.in_channels, s.height, s.width, embeds.dtype,
                                       self.device, self.generators([request]))
        patch = pipe.transformer.config.patch_size
        image_tokens = (latents.shape[2] // patch) * (latents.shape[3] // patch)
        scheduler = request_flow_scheduler(pipe.scheduler, s.num_inference_steps, self.device, image_tokens,
                                           SD3_MAX_SHIFT)
        return StepRequestState(request, scheduler, latents, do_cfg, cond={"embeds": embeds, "pooled": pooled})

    def denoise_step(self, states: list[StepRequestState]) -> list[torch.Tensor]:
        rows = [torch.cat([st.latents] * 2) if st.do_cfg else st.latents for st in states]
        timesteps = torch.cat([st.timestep.expand(len(r)) for st, r in zip(states, rows, strict=True)])
        with self.lora_rows("transformer", [(st.request, len(r)) for st, r in zip(states, rows, strict=True)]):
            noise = self.pipe.transformer(
                hidden_states=torch.cat(rows), timestep=timesteps,
                encoder_hidden_states=torch.cat([st.cond["embeds"] for st in states]),
                pooled_projections=torch.cat([st.cond["pooled"] for st in states]), joint_attention_kwargs=None,
                return_dict=False)[0]
        return self.guided_per_request(states, noise, rows)
