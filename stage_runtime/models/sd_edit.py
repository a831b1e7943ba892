"""Edits for the Stable Diffusion family: img2img and (4-channel) inpainting over the generation components.

A generation folder (``StableDiffusionPipeline``) serves edits too: ``StableDiffusionImg2ImgPipeline``
and ``StableDiffusionInpaintPipeline`` are built with ``from_pipe`` over the SAME modules (no second copy
of any weight). Request mode calls those pipelines; step mode repeats their math one step at a time:

    img2img   image → VAE latents (the image's generator) → noised to timestep t_start → the last
              int(steps × strength) steps of the schedule
    inpaint   the same, and after every step the unmasked region is put back: the image latents noised to
              the next timestep (the 4-channel UNet blend of StableDiffusionInpaintPipeline)

Each image row uses the request's generator for that row, so an edit equals its solo diffusers call
whatever it is batched with. Edits are limited to schedulers of order 1 in step mode (DDIM, Euler…).
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import StableDiffusionImg2ImgPipeline, StableDiffusionInpaintPipeline
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img import retrieve_latents
from diffusers.utils.torch_utils import randn_tensor
from PIL import Image

from stage_runtime.models.step_state import StepRequestState
from stage_runtime.request import DiffusionRequest, EditInput

EDIT_TASKS = ("img2img", "inpaint")


def pil_image(edit: EditInput, height: int, width: int) -> Image.Image:
    """The upload as PIL, resized (Lanczos) to the request's size when it asked for another one."""
    image = Image.fromarray(edit.image, mode="RGB")
    return image if image.size == (width, height) else image.resize((width, height), Image.LANCZOS)


def pil_mask(edit: EditInput, height: int, width: int) -> Image.Image:
    mask = Image.fromarray(edit.mask, mode="L")
    return mask if mask.size == (width, height) else mask.resize((width, height), Image.NEAREST)


class StableDiffusionEditMixin:
    """Edit support for an SD-style adapter (``self.pipe`` a StableDiffusionPipeline)."""

    def edit_tasks(self) -> tuple[str, ...]:
        return EDIT_TASKS if self.pipe.unet.config.in_channels == 4 else ()

    def _edit_pipelines(self):
        if getattr(self, "_edit_pipes", None) is None:
            self._edit_pipes = {"img2img": StableDiffusionImg2ImgPipeline.from_pipe(self.pipe),
                                "inpaint": StableDiffusionInpaintPipeline.from_pipe(self.pipe)}
            for pipe in self._edit_pipes.values():
                pipe.set_progress_bar_config(disable=True)
        return self._edit_pipes

    # -- request mode: ONE diffusers call for key-compatible edits (same task, strength, size, steps) ----
    def run_edit_batch(self, requests: list[DiffusionRequest]) -> dict[str, np.ndarray]:
        s, edit = requests[0].sampling, requests[0].edit
        rows = [r for r in requests for _ in range(r.sampling.num_outputs)]
        kwargs = dict(prompt=[r.prompt for r in rows], negative_prompt=[r.sampling.negative_prompt or "" for r in rows],
                      image=[pil_image(r.edit, s.height, s.width) for r in rows], strength=edit.strength,
                      num_inference_steps=s.num_inference_steps, guidance_scale=s.guidance_scale,
                      generator=self.generators(requests), output_type="np", return_dict=False)
        if edit.task == "inpaint":
            kwargs.update(mask_image=[pil_mask(r.edit, s.height, s.width) for r in rows], height=s.height, width=s.width)
        images = self._edit_pipelines()[edit.task](**kwargs)[0]
        return self.split_images(requests, images)

    # -- step mode ----------------------------------------------------------------------------------------
    def prepare_edit(self, request: DiffusionRequest, state: StepRequestState, generators: list) -> None:
        """Turn a fresh text-to-image state into the edit's: latents from the image, the schedule's tail."""
        s, edit, pipe, n = request.sampling, request.edit, self.pipe, request.sampling.num_outputs
        scheduler = state.scheduler
        state.t_start = (s.num_inference_steps - edit.denoise_steps(s.num_inference_steps)) * scheduler.order
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(state.t_start)
        dtype = state.latents.dtype
        image = pipe.image_processor.preprocess(pil_image(edit, s.height, s.width), height=s.height, width=s.width)
        image = torch.cat([image] * n).to(self.device, pipe.vae.dtype)       # (SDXL may run its VAE in float32)
        image_latents = torch.cat([retrieve_latents(pipe.vae.encode(image[i:i + 1]), generator=generators[i])
                                   for i in range(n)]).to(dtype) * pipe.vae.config.scaling_factor
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

    def step_scheduler(self, state: StepRequestState, noise_pred: torch.Tensor) -> None:
        super().step_scheduler(state, noise_pred)
        if "mask" not in state.edit:
            return
        proper = state.edit["image_latents"]
        if not state.finished:
            proper = state.scheduler.add_noise(proper, state.edit["noise"], state.timestep.reshape(1))
        mask = state.edit["mask"]
        state.latents = (1 - mask) * proper + mask * state.latents
