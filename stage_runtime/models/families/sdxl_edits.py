"""SDXL edits from a generation folder: img2img (``StableDiffusionXLImg2ImgPipeline``) and inpainting
(``StableDiffusionXLInpaintPipeline``, a 4-channel UNet), both built with ``from_pipe`` over the generation
folder's modules (no weight copied; ``requires_aesthetics_score`` False, so the micro-conditioning is the
generation's: original size, crop (0, 0), target size). Request mode calls those pipelines with the per-request
embeddings (as the generation path); step mode is Stable Diffusion's edit math (``sd.StableDiffusionEditMixin``):

    img2img   the image encoded per image row (each row's generator), noised to timestep t_start, the tail of
              the schedule: int(steps × strength) steps
    inpaint   the image encoded ONCE with the request's first generator and repeated (SDXL's inpaint
              pipeline encodes a prompt's image once for ``num_images_per_prompt``); strength 1 starts from pure
              noise; after every step the unmasked region is put back (the image latents noised to the next
              timestep). Request mode hands the fused call those latents as ``image`` (and as
              ``masked_image_latents``, which a 4-channel UNet never reads; ``sd``'s call), so an inpaint equals
              its solo diffusers call whatever it is batched with.

The VAE encodes in float32 when its config says ``force_upcast`` (as the pipelines do). Fresh generators in step
mode: the pipelines draw the image's latent sample, then the noise, then (Euler) each step's noise from the same
generators, so the text-to-image latents drawn first are discarded and the noise scheduler's step kwargs get the
fresh generators. The inpaint pipeline also encodes the masked picture (a latent sample drawn after the noise)
for a 9-channel UNet only to use; with a scheduler whose step draws noise that draw would shift the step noise,
so edits stay exact with schedulers whose step draws none (Euler, DDIM: SDXL's), as for Stable Diffusion.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from diffusers import StableDiffusionXLImg2ImgPipeline, StableDiffusionXLInpaintPipeline

from stage_runtime.models.families.sd import StableDiffusionEditMixin
from stage_runtime.models.step_state import StepRequestState
from stage_runtime.request import DiffusionRequest


class StableDiffusionXLEditMixin(StableDiffusionEditMixin):
    """img2img and inpainting for an SDXL adapter (``self.pipe`` a StableDiffusionXLPipeline)."""

    def edit_tasks(self) -> tuple[str, ...]:
        return ("img2img", "inpaint") if self.pipe.unet.config.in_channels == 4 else ()

    def _edit_pipelines(self):
        if getattr(self, "_edit_pipes", None) is None:
            self._edit_pipes = {
                "img2img": StableDiffusionXLImg2ImgPipeline.from_pipe(self.pipe, requires_aesthetics_score=False),
                "inpaint": StableDiffusionXLInpaintPipeline.from_pipe(self.pipe, requires_aesthetics_score=False)}
            for pipe in self._edit_pipes.values():
                pipe.set_progress_bar_config(disable=True)
        return self._edit_pipes

    @contextlib.contextmanager
    def vae_upcast(self):
        """The VAE in float32 while it encodes, when its config says ``force_upcast`` (SDXL's VAE overflows in
        float16), and back in the serving dtype after."""
        vae = self.pipe.vae
        dtype = vae.dtype
        upcast = vae.config.force_upcast and dtype != torch.float32
        if upcast:
            vae.to(dtype=torch.float32)
        try:
            yield
        finally:
            if upcast:
                vae.to(dtype=dtype)

    def edit_image_latents(self, request: DiffusionRequest, generators: list, dtype: torch.dtype,
                           rows: int | None = None) -> torch.Tensor:
        """The SD encode (``sd``: an inpaint's image once), in float32 where the VAE needs it."""
        with self.vae_upcast():
            return super().edit_image_latents(request, generators, dtype, rows)

    def run_edit_batch(self, requests: list[DiffusionRequest], embeddings: dict | None = None) -> dict[str, np.ndarray]:
        """SD's edit call (``sd``) with SDXL's fused prompt embeddings."""
        return super().run_edit_batch(requests, self.fused_embeddings(requests) if embeddings is None else embeddings)

    def prepare_edit(self, request: DiffusionRequest, state: StepRequestState, generators=None) -> None:
        generators = self.generators([request])
        super().prepare_edit(request, state, generators)
        state.step_kwargs = self.pipe.prepare_extra_step_kwargs(generators, 0.0)
