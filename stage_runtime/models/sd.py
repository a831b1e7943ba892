"""Stable-Diffusion-style pipelines (UNet2DConditionModel + AutoencoderKL + CLIP text encoder)."""

from __future__ import annotations

import numpy as np
import torch

from stage_runtime.models.adapter import PipelineAdapter
from stage_runtime.request import DiffusionRequest


class StableDiffusionAdapter(PipelineAdapter):
    default_guidance = 7.5

    @property
    def denoiser(self) -> torch.nn.Module:
        return self.pipe.unet

    def default_size(self) -> tuple[int, int]:
        side = self.pipe.unet.config.sample_size * self.vae_scale_factor
        return side, side

    def run_batch(self, requests: list[DiffusionRequest]) -> dict[str, np.ndarray]:
        s = requests[0].sampling           # key-compatible: shape, steps and guidance are shared
        rows = [(r.prompt, r.sampling.negative_prompt or "") for r in requests for _ in range(r.sampling.num_outputs)]
        images = self.pipe(
            prompt=[p for p, _ in rows], negative_prompt=[n for _, n in rows],
            height=s.height, width=s.width, num_inference_steps=s.num_inference_steps,
            guidance_scale=s.guidance_scale, generator=self.generators(requests),
            output_type="np", return_dict=False)[0]
        return self.split_images(requests, images)
