"""Stable-Diffusion-style pipelines (UNet2DConditionModel + AutoencoderKL + CLIP text encoder), with their edits.

A generation folder (``StableDiffusionPipeline``) serves edits too: ``StableDiffusionImg2ImgPipeline`` and
``StableDiffusionInpaintPipeline`` are built with ``from_pipe`` over the SAME modules (no second copy of any
weight). Request mode calls those pipelines; step mode repeats their math one step at a time:

    img2img   image → VAE latents (the image's generator) → noised to timestep t_start → the last
              int(steps × strength) steps of the schedule
    inpaint   the same, and after every step the unmasked region is put back: the image latents noised to
              the next timestep (the 4-channel UNet blend of StableDiffusionInpaintPipeline)

Each image row uses the request's generator for that row, so an edit equals its solo diffusers call whatever
it is batched with. Edits are limited to noise schedulers of order 1 in step mode (DDIM, Euler…).

LoRA rows: the text encoder sees each prompt row (positive, then negative: one call each), the UNet
[uncond rows; cond rows] under CFG; every pipeline here (edits too) calls them that way.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import StableDiffusionImg2ImgPipeline, StableDiffusionInpaintPipeline
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img import retrieve_latents
from diffusers.utils.torch_utils import randn_tensor

from stage_runtime.models.adapter import PipelineAdapter
from stage_runtime.models.edit_images import pil_image, pil_mask
from stage_runtime.models.step_contract import StepContract
from stage_runtime.models.step_state import StepRequestState
from stage_runtime.request import DiffusionRequest


class StableDiffusionEditMixin:
    """img2img and (4-channel) inpainting for an SD-style adapter (``self.pipe`` a StableDiffusionPipeline)."""

    def edit_tasks(self) -> tuple[str, ...]:
        return ("img2img", "inpaint") if self.pipe.unet.config.in_channels == 4 else ()

    def _edit_pipelines(self):
        if getattr(self, "_edit_pipes", None) is None:
            self._edit_pipes = {"img2img": StableDiffusionImg2ImgPipeline.from_pipe(self.pipe),
                                "inpaint": StableDiffusionInpaintPipeline.from_pipe(self.pipe)}
            for pipe in self._edit_pipes.values():
                pipe.set_progress_bar_config(disable=True)
        return self._edit_pipes

    # -- request mode: ONE diffusers call for key-compatible edits (same task, strength, size, steps) ----
    def run_edit_batch(self, requests: list[DiffusionRequest], prompts: dict | None = None) -> dict[str, np.ndarray]:
        """``prompts``: the call's prompt keywords (default: the prompts as text; SDXL hands its fused embeddings)."""
        s, edit, rows = requests[0].sampling, requests[0].edit, self.image_rows(requests)
        prompts = self.prompt_kwargs(requests) if prompts is None else prompts
        if edit.task == "img2img":
            return self.call_pipeline(requests, self._edit_pipelines()["img2img"], **prompts,
                                      image=[pil_image(r.edit, s.height, s.width) for r in rows],
                                      strength=edit.strength)
        # The inpaint pipeline encodes a prompt's picture once for its num_images_per_prompt, with the first
        # generator; a fused call of several requests would encode one picture per row. So each request's latents
        # are encoded here, as its solo call would, and handed over as the image (4-channel latents are taken as
        # they are): an inpaint equals its solo diffusers call whatever it is fused with. They go in as
        # ``masked_image_latents`` too, which a 4-channel UNet never reads: the pipeline would otherwise mask the
        # latents with the picture-sized mask.
        generators, latents, row = self.generators(requests), [], 0     # the encode draws first, then the call
        for r in requests:
            n = r.sampling.num_outputs
            latents.append(self.edit_image_latents(r, generators[row:row + n], self.pipe.unet.dtype))
            row += n
        return self.call_pipeline(requests, self._edit_pipelines()["inpaint"], generators, **prompts,
                                  image=torch.cat(latents),
                                  masked_image_latents=torch.cat(latents),
                                  mask_image=[pil_mask(r.edit, s.height, s.width) for r in rows],
                                  strength=edit.strength)

    # -- step mode ----------------------------------------------------------------------------------------
    def edit_image_latents(self, request: DiffusionRequest, generators: list, dtype: torch.dtype,
                           rows: int | None = None) -> torch.Tensor:
        """(n, 4, h, w) scaled VAE latents of the request's image for its n images: the image encoded ``rows``
        times (default: n for img2img, once per image with that image's generator, as the img2img pipelines encode
        the image repeated per row; 1 for inpainting, once with the first generator, repeated, as the inpaint
        pipelines encode a prompt's picture for num_images_per_prompt)."""
        s, pipe, n = request.sampling, self.pipe, request.sampling.num_outputs
        rows = (1 if request.edit.task == "inpaint" else n) if rows is None else rows
        image = pipe.image_processor.preprocess(pil_image(request.edit, s.height, s.width), height=s.height,
                                                width=s.width)
        image = torch.cat([image] * rows).to(self.device, pipe.vae.dtype)    # (SDXL may run its VAE in float32)
        latents = torch.cat([retrieve_latents(pipe.vae.encode(image[i:i + 1]), generator=generators[i])
                             for i in range(rows)]).to(dtype) * pipe.vae.config.scaling_factor
        return torch.cat([latents] * (n // rows))

    def prepare_edit(self, request: DiffusionRequest, state: StepRequestState, generators: list) -> None:
        """Turn a fresh text-to-image state into the edit's: latents from the image, the schedule's tail."""
        s, edit, pipe, n = request.sampling, request.edit, self.pipe, request.sampling.num_outputs
        scheduler = state.noise_scheduler
        state.t_start = (s.num_inference_steps - edit.denoise_steps(s.num_inference_steps)) * scheduler.order
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(state.t_start)
        dtype = state.latents.dtype
        image_latents = self.edit_image_latents(request, generators, dtype)
        noise = randn_tensor(image_latents.shape, generator=generators, device=self.device, dtype=dtype)
        latent_timestep = scheduler.timesteps[state.t_start:state.t_start + 1].repeat(n)
        if edit.task == "inpaint" and edit.strength == 1.0:
            state.latents = noise * scheduler.init_noise_sigma
        else:
            state.latents = scheduler.add_noise(image_latents, noise, latent_timestep)
        if edit.task == "inpaint":
            mask = self._edit_pipelines()["inpaint"].mask_processor.preprocess(
                pil_mask(edit, s.height, s.width), height=s.height, width=s.width)
            mask = torch.nn.functional.interpolate(mask, size=state.latents.shape[-2:]).to(self.device, dtype)
            state.edit = {"mask": torch.cat([mask] * n), "image_latents": image_latents, "noise": noise}

    def noise_step(self, state: StepRequestState, noise_pred: torch.Tensor) -> None:
        super().noise_step(state, noise_pred)
        if "mask" not in state.edit:
            return
        proper = state.edit["image_latents"]
        if not state.finished:
            proper = state.noise_scheduler.add_noise(proper, state.edit["noise"], state.timestep.reshape(1))
        mask = state.edit["mask"]
        state.latents = (1 - mask) * proper + mask * state.latents


class StableDiffusionAdapter(StableDiffusionEditMixin, StepContract, PipelineAdapter):
    pipeline_classes = ("StableDiffusionPipeline",)
    tiny_kinds = ("sd",)
    denoiser_name = "unet"
    default_guidance = 7.5
    parallel_kinds = frozenset({"cfg", "ulysses"})
    lora_components = ("unet", "text_encoder")

    def do_cfg(self, guidance_scale: float) -> bool:
        return guidance_scale > 1 and self.pipe.unet.config.time_cond_proj_dim is None

    def run_batch(self, requests: list[DiffusionRequest]) -> dict[str, np.ndarray]:
        cfg_rows = 2 if self.do_cfg(requests[0].sampling.guidance_scale) else 1
        with self.batch_lora_rows(requests, cfg_rows):
            if requests[0].edit is not None:
                return self.run_edit_batch(requests)
            return self.call_pipeline(requests, **self.prompt_kwargs(requests))

    # -- step contract: the same math as StableDiffusionPipeline.__call__, one step at a time ------------
    def prepare_encode(self, request: DiffusionRequest) -> StepRequestState:
        s, pipe, n = request.sampling, self.pipe, request.sampling.num_outputs
        do_cfg = self.do_cfg(s.guidance_scale)
        with self.batch_lora_rows([request], components=self.encoder_lora_components):
            positive, negative = pipe.encode_prompt([request.prompt] * n, self.device, 1, do_cfg,
                                                    [s.negative_prompt or ""] * n)
        scheduler = self.noise_scheduler_for(s.num_inference_steps)
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
