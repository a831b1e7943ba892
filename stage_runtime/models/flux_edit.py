"""img2img for FLUX.1 (FluxImg2ImgPipeline semantics) over the generation components.

A generation folder (``FluxPipeline``) serves img2img too: ``FluxImg2ImgPipeline`` is built with
``from_pipe`` over the SAME modules (no weight copied). Request mode calls it; step mode repeats its math:

    image → VAE latents (the row's generator), normalised (z − shift) × scale → noise (the same generators)
    → ``scale_noise`` to the sigma at timestep t_start (flow matching: (1 − σ)·x + σ·noise) → 2x2 packed
    → the schedule's tail, ``FluxImg2ImgPipeline.get_timesteps``' count: steps − int(steps − steps × strength)
      (a float product, unlike Stable Diffusion's int(steps × strength): the two differ for e.g. 10 × 0.3)

A request's image is encoded ONCE, with its first image's generator, and repeated for its other images
(FluxImg2ImgPipeline encodes a prompt's image once for ``num_images_per_prompt``; unlike SD and SDXL, which
encode it per image); the noise is drawn per image. Request mode hands the fused call those latents as
``image`` (the pipeline takes latents as they are), so an edit equals its solo diffusers call whatever it is
batched with.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import FluxImg2ImgPipeline
from diffusers.utils.torch_utils import randn_tensor

from stage_runtime.models.sd_edit import pil_image
from stage_runtime.models.step_state import StepRequestState
from stage_runtime.request import DiffusionRequest


class FluxEditMixin:
    """img2img for a FLUX adapter (``self.pipe`` a FluxPipeline)."""

    edit_step_rule = "flow"                # EditInput.denoise_steps: FluxImg2ImgPipeline's float rounding

    def edit_tasks(self) -> tuple[str, ...]:
        return ("img2img",)

    def _img2img_pipeline(self) -> FluxImg2ImgPipeline:
        if getattr(self, "_flux_img2img", None) is None:
            self._flux_img2img = FluxImg2ImgPipeline.from_pipe(self.pipe)
            self._flux_img2img.set_progress_bar_config(disable=True)
        return self._flux_img2img

    def edit_image_latents(self, requests: list[DiffusionRequest], generators: list) -> torch.Tensor:
        """(rows, C, h, w) normalised VAE latents: each request's image encoded once with the generator of its
        first row (which that draws from, as the pipeline's encode does), repeated for its images."""
        img2img, out, row = self._img2img_pipeline(), [], 0
        for r in requests:
            s = r.sampling
            image = img2img.image_processor.preprocess(pil_image(r.edit, s.height, s.width), height=s.height,
                                                       width=s.width)
            latents = img2img._encode_vae_image(image.to(self.device, self.pipe.vae.dtype), [generators[row]])
            out.append(torch.cat([latents] * s.num_outputs))
            row += s.num_outputs
        return torch.cat(out)

    # -- request mode: ONE diffusers call for key-compatible edits (same strength, size, steps, guidance) --
    def run_edit_batch(self, requests: list[DiffusionRequest]) -> dict[str, np.ndarray]:
        s, edit = requests[0].sampling, requests[0].edit
        generators = self.generators(requests)
        images = self._img2img_pipeline()(
            prompt=[r.prompt for r in requests for _ in range(r.sampling.num_outputs)],
            image=self.edit_image_latents(requests, generators), height=s.height, width=s.width,
            strength=edit.strength, num_inference_steps=s.num_inference_steps, guidance_scale=s.guidance_scale,
            generator=generators, max_sequence_length=self.max_sequence_length(), output_type="np",
            return_dict=False)[0]
        return self.split_images(requests, images)

    # -- step mode ----------------------------------------------------------------------------------------
    def prepare_edit(self, request: DiffusionRequest, state: StepRequestState) -> None:
        """Turn a fresh text-to-image state into the edit's: latents from the image, the schedule's tail.

        Fresh generators: FluxImg2ImgPipeline draws the image's latent sample first, then the noise (the
        text-to-image latents the generation path drew are discarded)."""
        s, edit, n = request.sampling, request.edit, request.sampling.num_outputs
        img2img, scheduler = self._img2img_pipeline(), state.scheduler
        state.t_start = (s.num_inference_steps - edit.denoise_steps(s.num_inference_steps)) * scheduler.order
        scheduler.set_begin_index(state.t_start)
        generators = self.generators([request])
        dtype = state.latents.dtype
        image_latents = self.edit_image_latents([request], generators).to(dtype)
        noise = randn_tensor(image_latents.shape, generator=generators, device=self.device, dtype=dtype)
        latents = scheduler.scale_noise(image_latents, scheduler.timesteps[state.t_start:state.t_start + 1].repeat(n),
                                        noise)
        channels, height, width = latents.shape[1:]
        state.latents = img2img._pack_latents(latents, n, channels, height, width)
