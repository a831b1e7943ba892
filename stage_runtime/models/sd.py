"""Stable-Diffusion-style pipelines (UNet2DConditionModel + AutoencoderKL + CLIP text encoder).

The same adapter serves edits (img2img, inpaint: ``sd_edit``) over the same components.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers.utils.torch_utils import randn_tensor

from stage_runtime.models.adapter import PipelineAdapter
from stage_runtime.models.sd_edit import StableDiffusionEditMixin
from stage_runtime.models.step_contract import StepContract
from stage_runtime.request import DiffusionRequest
from stage_runtime.models.step_state import StepRequestState


class StableDiffusionAdapter(StableDiffusionEditMixin, StepContract, PipelineAdapter):
    default_guidance = 7.5
    parallel_kinds = frozenset({"cfg", "ulysses"})
    lora_components = ("unet", "text_encoder")

    @property
    def denoiser(self) -> torch.nn.Module:
        return self.pipe.unet

    def default_size(self) -> tuple[int, int]:
        side = self.pipe.unet.config.sample_size * self.vae_scale_factor
        return side, side

    def do_cfg(self, guidance_scale: float) -> bool:
        return guidance_scale > 1 and self.pipe.unet.config.time_cond_proj_dim is None

    def run_batch(self, requests: list[DiffusionRequest]) -> dict[str, np.ndarray]:
        # LoRA rows: the text encoder sees each prompt row (positive, then negative: one call each), the UNet
        # [uncond rows; cond rows] under CFG; every pipeline below (edits too) calls them that way.
        rows = [(r, r.sampling.num_outputs) for r in requests]
        cfg_rows = 2 if self.do_cfg(requests[0].sampling.guidance_scale) else 1
        with self.lora_rows("text_encoder", rows), self.lora_rows("unet", rows, repeat=cfg_rows):
            if requests[0].edit is not None:
                return self.run_edit_batch(requests)
            return self._generate(requests)

    def _generate(self, requests: list[DiffusionRequest]) -> dict[str, np.ndarray]:
        s = requests[0].sampling           # key-compatible: shape, steps and guidance are shared
        rows = [(r.prompt, r.sampling.negative_prompt or "") for r in requests for _ in range(r.sampling.num_outputs)]
        images = self.pipe(
            prompt=[p for p, _ in rows], negative_prompt=[n for _, n in rows],
            height=s.height, width=s.width, num_inference_steps=s.num_inference_steps,
            guidance_scale=s.guidance_scale, generator=self.generators(requests),
            output_type="np", return_dict=False)[0]
        return self.split_images(requests, images)

    # -- step contract: the same math as StableDiffusionPipeline.__call__, one step at a time ------------
    def prepare_encode(self, request: DiffusionRequest) -> StepRequestState:
        s, pipe, n = request.sampling, self.pipe, request.sampling.num_outputs
        do_cfg = self.do_cfg(s.guidance_scale)
        with self.lora_rows("text_encoder", [(request, n)]):
            positive, negative = pipe.encode_prompt([request.prompt] * n, self.device, 1, do_cfg,
                                                    [s.negative_prompt or ""] * n)
        scheduler = self.request_scheduler(s.num_inference_steps)
        generators = self.generators([request])
        shape = (n, pipe.unet.config.in_channels, s.height // self.vae_scale_factor, s.width // self.vae_scale_factor)
        if request.edit is None:
            latents = randn_tensor(shape, generator=generators, device=self.device, dtype=positive.dtype)
        else:                                          # prepare_edit draws them from the image
            latents = torch.empty(shape, device=self.device, dtype=positive.dtype)
        state = StepRequestState(
            request, scheduler, latents * scheduler.init_noise_sigma, do_cfg,
            cond={"embeds": torch.cat([negative, positive]) if do_cfg else positive},
            step_kwargs=pipe.prepare_extra_step_kwargs(generators, 0.0))
        if request.edit is not None:
            self.prepare_edit(request, state, generators)
        return state

    def denoise_step(self, states: list[StepRequestState]) -> list[torch.Tensor]:
        rows, timesteps = self.model_inputs(states)
        with self.lora_rows("unet", [(st.request, len(r)) for st, r in zip(states, rows, strict=True)]):
            noise = self.pipe.unet(torch.cat(rows), timesteps,
                                   encoder_hidden_states=torch.cat([st.cond["embeds"] for st in states]),
                                   return_dict=False)[0]
        return self.guided_per_request(states, noise, rows)

    def post_decode(self, state: StepRequestState) -> np.ndarray:
        pipe = self.pipe
        image = pipe.vae.decode(state.latents / pipe.vae.config.scaling_factor, return_dict=False)[0]
        image = pipe.image_processor.postprocess(image, output_type="np", do_denormalize=[True] * len(image))
        return self.to_uint8(image)
