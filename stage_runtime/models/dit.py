"""DiT pipelines (class-conditional DiTTransformer2DModel + AutoencoderKL).

DiT is conditioned on an ImageNet-style class id, not text. A prompt maps to a class id: a decimal
number is taken as the id, a known label (the pipeline's ``id2label``) as its id, anything else as a
stable CRC32 hash of the text modulo the number of classes. The image size is fixed by the model.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from stage_runtime.errors import InvalidRequestError
from stage_runtime.models.adapter import PipelineAdapter
from stage_runtime.request import DiffusionRequest


class DiTAdapter(PipelineAdapter):
    default_guidance = 4.0
    fixed_size = True

    @property
    def denoiser(self) -> torch.nn.Module:
        return self.pipe.transformer

    def default_size(self) -> tuple[int, int]:
        side = self.pipe.transformer.config.sample_size * self.vae_scale_factor
        return side, side

    @property
    def num_classes(self) -> int:
        return int(self.pipe.transformer.config.num_embeds_ada_norm)

    def class_label(self, prompt: str) -> int:
        text = prompt.strip()
        if text.isdigit():
            return int(text)
        labels = getattr(self.pipe, "labels", None) or {}
        if text in labels:
            return int(labels[text])
        return zlib.crc32(text.encode()) % self.num_classes

    def check_request(self, request: DiffusionRequest) -> None:
        label = self.class_label(request.prompt)
        if label >= self.num_classes:
            raise InvalidRequestError("prompt", request.prompt, f"class id must be < {self.num_classes}")

    def run_batch(self, requests: list[DiffusionRequest]) -> dict[str, np.ndarray]:
        s = requests[0].sampling
        labels = [self.class_label(r.prompt) for r in requests for _ in range(r.sampling.num_outputs)]
        images = self.pipe(class_labels=labels, guidance_scale=s.guidance_scale, generator=self.generators(requests),
                           num_inference_steps=s.num_inference_steps, output_type="np", return_dict=False)[0]
        return self.split_images(requests, images)
