"""FLUX.1 Kontext (FluxKontextPipeline): FLUX.1 [dev] with instruction edits.

An instruction edit has no strength: it starts from noise and runs every step, and the input image
conditions the denoiser as extra tokens. Each step's transformer input is

    hidden_states   [output latents (L) ‖ the image's packed VAE latents (L)]   (argmax of the latent dist.)
    img_ids         [output position ids ‖ the image's ids, first axis 1]
    output          the first L tokens (the conditioning tokens' prediction is dropped)

The image is resized to the request's size (``size: auto`` = its own size rounded down to the size
multiple), i.e. FluxKontextPipeline with ``max_area = height × width`` and ``_auto_resize=False``: the
pipeline's preferred-resolution snap would condition a 64x64 edit on a 1024x1024 image. A Kontext folder
also serves generations (no image: FLUX.1 [dev]'s math).

True CFG (a negative prompt with ``true_cfg_scale > 1``) is FLUX.1's (models.families.flux): the negative rows carry the
same conditioning tokens, as FluxKontextPipeline's negative pass does.

Compatibility: an edit doubles the image tokens, so the step key adds the task (edits and generations
never share a forward); two edits of one size share ticks and fused calls. Parallel: none yet (FLUX's
Ulysses, ring and tensor parallel are untested with conditioning tokens). The block cache (models.block_cache) is FLUX's and
runs as it is: the conditioning tokens are part of the image stream whose residual it caches.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from stage_runtime.models.edit_images import pil_image
from stage_runtime.models.flow_match import flux_sigmas, request_flow_scheduler
from stage_runtime.models.families.flux import FLUX_MAX_SHIFT, FluxAdapter
from stage_runtime.models.step_state import StepRequestState
from stage_runtime.request import DiffusionRequest


class FluxKontextAdapter(FluxAdapter):
    pipeline_classes = ("FluxKontextPipeline",)
    tiny_kinds = ("flux-kontext",)
    parallel_kinds = frozenset()
    step_key_fields = ("height", "width", "task")
    edit_step_rule = "int"                 # unused: instruction edits run every step

    def edit_tasks(self) -> tuple[str, ...]:
        return ("instruct",)

    def parallel_refusal(self, kind: str) -> str | None:
        return ("FluxKontextPipeline: no in-model parallelism yet (FLUX's Ulysses, ring and tensor parallel are "
                "untested with the image conditioning tokens); use data parallelism (replicas)")

    # -- request mode ----------------------------------------------------------------------------------
    def run_batch(self, requests: list[DiffusionRequest]) -> dict[str, np.ndarray]:
        if requests[0].sampling.runs_true_cfg:           # diffusers makes two transformer calls a step: one here
            return self.run_step_loop(requests)
        s, kwargs = requests[0].sampling, {}          # key-compatible: size, steps, guidance and task are shared
        if requests[0].edit is not None:
            kwargs = {"image": [pil_image(r.edit, s.height, s.width) for r in self.image_rows(requests)],
                      "_auto_resize": False}
        with self.batch_lora_rows(requests):          # one row per image (CLIP, transformer)
            return self.call_pipeline(requests, **self.prompt_kwargs(requests, negative=False),
                                      max_area=s.height * s.width, max_sequence_length=self.max_sequence_length(),
                                      **kwargs)

    # -- step contract: FluxKontextPipeline.__call__, one step at a time ---------------------------------
    def prepare_encode(self, request: DiffusionRequest) -> StepRequestState:
        s, pipe, n = request.sampling, self.pipe, request.sampling.num_outputs
        cond = self.prompt_conditioning(request)
        image = None
        if request.edit is not None:
            image = pipe.image_processor.preprocess(pil_image(request.edit, s.height, s.width), s.height, s.width)
            image = torch.cat([image] * n)
        latents, image_latents, latent_ids, image_ids = pipe.prepare_latents(
            image, n, pipe.transformer.config.in_channels // 4, s.height, s.width, cond["embeds"].dtype, self.device,
            self.generators([request]))
        scheduler = request_flow_scheduler(pipe.scheduler, s.num_inference_steps, self.device, latents.shape[1],
                                           FLUX_MAX_SHIFT, flux_sigmas(s.num_inference_steps, pipe.scheduler.config))
        cond["image_ids"] = latent_ids if image_ids is None else torch.cat([latent_ids, image_ids])
        if image_latents is not None:
            cond["image_latents"] = image_latents
        return StepRequestState(request, scheduler, latents, do_cfg=s.runs_true_cfg, cond=cond)

    def denoise_step(self, states: list[StepRequestState]) -> list[torch.Tensor]:
        if "image_latents" not in states[0].cond:           # generations (the step key keeps tasks apart)
            return super().denoise_step(states)
        joint = [replace(st, latents=torch.cat([st.latents, st.cond["image_latents"]], dim=1)) for st in states]
        preds = super().denoise_step(joint)
        return [pred[:, :st.latents.shape[1]] for pred, st in zip(preds, states, strict=True)]
