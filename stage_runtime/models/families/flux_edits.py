"""FLUX.1 edits from a generation folder: img2img (``FluxImg2ImgPipeline``) and inpainting (``FluxInpaintPipeline``),
both built with ``from_pipe`` over the SAME modules (no weight copied). Request mode calls those pipelines; step
mode repeats their math:

    img2img   image → VAE latents (the row's generator), normalised (z − shift) × scale → noise (the same
              generators) → ``scale_noise`` to the sigma at timestep t_start (flow matching: (1 − σ)·x + σ·noise)
              → 2x2 packed → the schedule's tail, ``get_timesteps``' count: steps − int(steps − steps × strength)
              (a float product, unlike Stable Diffusion's int(steps × strength): the two differ for e.g. 10 × 0.3)
    inpaint   the same start (FluxInpaintPipeline has no strength-1 special case: σ = 1 is pure noise), and after
              every step the region outside the mask is put back: the packed image latents ``scale_noise``d to the
              next sigma (the clean ones after the last step); the mask is binarised, resized (nearest) to the
              latent grid and packed like the latents, 1 = repaint

A request's image is encoded ONCE, with its first image's generator, and repeated for its other images (both
pipelines encode a prompt's image once for ``num_images_per_prompt``; unlike SD and SDXL img2img, which encode
it per image); the noise is drawn per image. Request mode hands the fused call those latents as ``image`` (the
pipelines take latents as they are), so an edit equals its solo diffusers call whatever it is batched with. The
inpaint call also gets the masked picture (``masked_image_latents`` in pixels: the pipeline would otherwise mask
the latents with a pixel-sized mask); FLUX.1's 64-channel transformer never reads its encoding, which the
pipeline draws from the generators after the noise, so it changes no image (flow matching steps draw nothing).
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import FluxImg2ImgPipeline, FluxInpaintPipeline
from diffusers.utils.torch_utils import randn_tensor

from stage_runtime.models.edit_images import pil_image, pil_mask
from stage_runtime.models.step_state import StepRequestState
from stage_runtime.request import DiffusionRequest


class FluxEditMixin:
    """img2img and inpainting for a FLUX adapter (``self.pipe`` a FluxPipeline)."""

    edit_step_rule = "flow"                # EditInput.denoise_steps: the FLUX pipelines' float rounding

    def edit_tasks(self) -> tuple[str, ...]:
        return ("img2img", "inpaint")

    def _flux_edit_pipelines(self) -> dict:
        if getattr(self, "_flux_edits", None) is None:
            self._flux_edits = {"img2img": FluxImg2ImgPipeline.from_pipe(self.pipe),
                                "inpaint": FluxInpaintPipeline.from_pipe(self.pipe)}
            for pipe in self._flux_edits.values():
                pipe.set_progress_bar_config(disable=True)
        return self._flux_edits

    def edit_image_latents(self, requests: list[DiffusionRequest], generators: list) -> torch.Tensor:
        """(rows, C, h, w) normalised VAE latents: each request's image encoded once with the generator of its
        first row (which that draws from, as the pipelines' encode does), repeated for its images."""
        img2img, out, row = self._flux_edit_pipelines()["img2img"], [], 0
        for r in requests:
            s = r.sampling
            image = img2img.image_processor.preprocess(pil_image(r.edit, s.height, s.width), height=s.height,
                                                       width=s.width)
            latents = img2img._encode_vae_image(image.to(self.device, self.pipe.vae.dtype), [generators[row]])
            out.append(torch.cat([latents] * s.num_outputs))
            row += s.num_outputs
        return torch.cat(out)

    # -- request mode: ONE diffusers call for key-compatible edits (same task, strength, size, steps, guidance) --
    def run_edit_batch(self, requests: list[DiffusionRequest]) -> dict[str, np.ndarray]:
        s, edit, pipes = requests[0].sampling, requests[0].edit, self._flux_edit_pipelines()
        generators = self.generators(requests)         # the encode draws from them first, then the call
        kwargs = {"image": self.edit_image_latents(requests, generators), "strength": edit.strength,
                  "max_sequence_length": self.max_sequence_length()}
        if edit.task == "inpaint":
            inpaint, rows = pipes["inpaint"], self.image_rows(requests)
            masks = [pil_mask(r.edit, s.height, s.width) for r in rows]
            pixels = inpaint.image_processor.preprocess([pil_image(r.edit, s.height, s.width) for r in rows],
                                                        height=s.height, width=s.width)
            keep = inpaint.mask_processor.preprocess(masks, height=s.height, width=s.width) < 0.5
            kwargs.update(mask_image=masks, masked_image_latents=pixels * keep)
        return self.call_pipeline(requests, pipes[edit.task], generators,
                                  **self.prompt_kwargs(requests, negative=False), **kwargs)

    # -- step mode ----------------------------------------------------------------------------------------
    def prepare_edit(self, request: DiffusionRequest, state: StepRequestState) -> None:
        """Turn a fresh text-to-image state into the edit's: latents from the image, the schedule's tail (and for
        inpainting the mask, the image latents and the noise that ``noise_step`` blends back).

        Fresh generators: the pipelines draw the image's latent sample first, then the noise (the text-to-image
        latents the generation path drew are discarded)."""
        s, edit, n = request.sampling, request.edit, request.sampling.num_outputs
        pipes, scheduler = self._flux_edit_pipelines(), state.noise_scheduler
        state.t_start = (s.num_inference_steps - edit.denoise_steps(s.num_inference_steps)) * scheduler.order
        scheduler.set_begin_index(state.t_start)
        generators = self.generators([request])
        dtype = state.latents.dtype
        image_latents = self.edit_image_latents([request], generators).to(dtype)
        noise = randn_tensor(image_latents.shape, generator=generators, device=self.device, dtype=dtype)
        latents = scheduler.scale_noise(image_latents, scheduler.timesteps[state.t_start:state.t_start + 1].repeat(n),
                                        noise)
        channels, height, width = latents.shape[1:]
        pack = pipes["img2img"]._pack_latents
        state.latents = pack(latents, n, channels, height, width)
        if edit.task == "inpaint":
            mask = pipes["inpaint"].mask_processor.preprocess(pil_mask(edit, s.height, s.width), height=s.height,
                                                              width=s.width)
            mask = torch.nn.functional.interpolate(mask, size=(height, width)).to(self.device, dtype)
            state.edit = {"mask": pack(torch.cat([mask] * n).repeat(1, channels, 1, 1), n, channels, height, width),
                          "image_latents": pack(image_latents, n, channels, height, width),
                          "noise": pack(noise, n, channels, height, width)}

    def noise_step(self, state: StepRequestState, noise_pred: torch.Tensor) -> None:
        super().noise_step(state, noise_pred)
        if "mask" not in state.edit:
            return
        proper = state.edit["image_latents"]
        if not state.finished:             # the scheduler now stands at the next step: scale_noise takes its sigma
            proper = state.noise_scheduler.scale_noise(proper, state.timestep.reshape(1), state.edit["noise"])
        mask = state.edit["mask"]
        state.latents = (1 - mask) * proper + mask * state.latents
