"""img2img for Stable Diffusion XL (StableDiffusionXLImg2ImgPipeline semantics) over the generation components.

``StableDiffusionXLImg2ImgPipeline`` is built with ``from_pipe`` over the generation folder's modules (no
weight copied; ``requires_aesthetics_score`` False, so the micro-conditioning is the generation's: original
size, crop (0, 0), target size). Request mode calls it with the per-request embeddings (as the generation
path); step mode is Stable Diffusion's img2img math (``sd_edit``): image → VAE latents (the row's
generator) × scaling factor → noise → ``add_noise`` at timestep t_start → the last int(steps × strength)
steps. The VAE encodes in float32 when its config says ``force_upcast`` (as the pipeline does).

Fresh generators in step mode: the pipeline draws the image's latent sample, then the noise, then (Euler)
each step's noise from the same generators, so the text-to-image latents drawn first are discarded and the
scheduler's step kwargs get the fresh generators.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import StableDiffusionXLImg2ImgPipeline

from stage_runtime.models.sd_edit import StableDiffusionEditMixin, pil_image
from stage_runtime.models.step_state import StepRequestState
from stage_runtime.request import DiffusionRequest


class StableDiffusionXLEditMixin(StableDiffusionEditMixin):
    """img2img for an SDXL adapter (``self.pipe`` a StableDiffusionXLPipeline)."""

    def edit_tasks(self) -> tuple[str, ...]:
        return ("img2img",) if self.pipe.unet.config.in_channels == 4 else ()

    def _edit_pipelines(self):
        if getattr(self, "_edit_pipes", None) is None:
            img2img = StableDiffusionXLImg2ImgPipeline.from_pipe(self.pipe, requires_aesthetics_score=False)
            img2img.set_progress_bar_config(disable=True)
            self._edit_pipes = {"img2img": img2img}
        return self._edit_pipes

    # -- request mode: ONE diffusers call for key-compatible edits, per-request embeddings ----------------
    def run_edit_batch(self, requests: list[DiffusionRequest]) -> dict[str, np.ndarray]:
        s, edit = requests[0].sampling, requests[0].edit
        images = self._edit_pipelines()["img2img"](
            **self.fused_embeddings(requests),
            image=[pil_image(r.edit, s.height, s.width) for r in requests for _ in range(r.sampling.num_outputs)],
            strength=edit.strength, num_inference_steps=s.num_inference_steps, guidance_scale=s.guidance_scale,
            generator=self.generators(requests), output_type="np", return_dict=False)[0]
        return self.split_images(requests, images)

    def fused_embeddings(self, requests: list[DiffusionRequest]) -> dict[str, torch.Tensor | None]:
        """Each request's own encoding (``encode``), concatenated in row order, as the pipeline's keywords."""
        encoded = [self.encode(r) for r in requests]
        names = ("prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds", "negative_pooled_prompt_embeds")
        return {name: None if encoded[0][i] is None else torch.cat([e[i] for e in encoded])
                for i, name in enumerate(names)}

    # -- step mode ----------------------------------------------------------------------------------------
    def prepare_edit(self, request: DiffusionRequest, state: StepRequestState, generators=None) -> None:
        generators = self.generators([request])
        vae, dtype = self.pipe.vae, state.latents.dtype
        upcast = vae.config.force_upcast and vae.dtype != torch.float32
        if upcast:
            vae.to(dtype=torch.float32)
        try:
            super().prepare_edit(request, state, generators)
        finally:
            if upcast:
                vae.to(dtype=dtype)
        state.step_kwargs = self.pipe.prepare_extra_step_kwargs(generators, 0.0)
