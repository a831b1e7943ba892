"""Stable Diffusion XL (StableDiffusionXLPipeline): two CLIP text encoders, pooled embeddings, size/crop
micro-conditioning, classifier-free guidance over ``[uncond; cond]`` rows of one UNet call.

Conditioning of one image (what ``StableDiffusionXLPipeline.__call__`` builds, built here the same way):

    encoder_hidden_states   (77, C1 + C2)   penultimate hidden states of both encoders, concatenated
    text_embeds             (P,)            text_encoder_2's pooled projection
    time_ids                (6,)            original size (h, w) + crop top-left (0, 0) + target size (h, w)

Without a negative prompt the unconditional rows are zeros (``force_zeros_for_empty_prompt``, SDXL's
default); with one they are its encoding. Request mode encodes each request alone and hands the fused
call the embeddings, so a request's conditioning never depends on its batch-mates.

LoRA (``unet``, ``text_encoder``, ``text_encoder_2``, as StableDiffusionXLLoraLoaderMixin): each request is
encoded alone, so both text encoders see its n rows per call (prompt, then negative prompt); the UNet its
``[uncond; cond]`` rows — the whole wave twice in request mode, each request's 2n rows in step mode.

Parallel: CFG-parallel splits the rows (the ``added_cond_kwargs`` tensors included); Ulysses shards
the tokens of the UNet's transformer blocks (BasicTransformerBlock, as SD's): both are the defaults.

Edits (img2img, inpainting) over the generation components: ``models.families.sdxl_edits``.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers.utils.torch_utils import randn_tensor

from stage_runtime.errors import ConfigError
from stage_runtime.models.adapter import PipelineAdapter
from stage_runtime.models.families.sdxl_edits import StableDiffusionXLEditMixin
from stage_runtime.models.step_contract import StepContract
from stage_runtime.models.step_state import StepRequestState
from stage_runtime.request import DiffusionRequest


class StableDiffusionXLAdapter(StableDiffusionXLEditMixin, StepContract, PipelineAdapter):
    pipeline_classes = ("StableDiffusionXLPipeline",)
    tiny_kinds = ("sdxl",)
    denoiser_name = "unet"
    default_steps = 30
    default_guidance = 5.0
    parallel_kinds = frozenset({"cfg", "ulysses"})
    block_lists = ("down_blocks", "mid_block", "up_blocks")        # the UNet, in execution order
    lora_components = ("unet", "text_encoder", "text_encoder_2")   # as StableDiffusionXLLoraLoaderMixin

    def __init__(self, pipeline, device: torch.device):
        super().__init__(pipeline, device)
        config = pipeline.unet.config
        if config.addition_embed_type != "text_time":
            raise ConfigError(f"StableDiffusionXLPipeline: unet.addition_embed_type={config.addition_embed_type!r}, "
                              "expected 'text_time' (SDXL micro-conditioning)")

    # -- conditioning, shared by request and step mode ---------------------------------------------------
    def do_cfg(self, request: DiffusionRequest) -> bool:
        return request.sampling.guidance_scale > 1 and self.pipe.unet.config.time_cond_proj_dim is None

    def encode(self, request: DiffusionRequest) -> tuple[torch.Tensor, ...]:
        """(embeds, negative embeds, pooled, negative pooled) for the request's num_outputs images; both text
        encoders see the request's n rows per call (prompt, then negative prompt), its LoRA rows set."""
        n, negative = request.sampling.num_outputs, request.sampling.negative_prompt
        with self.batch_lora_rows([request], components=self.encoder_lora_components):
            return self.pipe.encode_prompt(
                [request.prompt] * n, device=self.device, num_images_per_prompt=1,
                do_classifier_free_guidance=self.do_cfg(request),
                negative_prompt=None if negative is None else [negative] * n)

    def time_ids(self, request: DiffusionRequest, dtype: torch.dtype) -> torch.Tensor:
        """(num_outputs, 6): original size, crop top-left, target size — the image's own size, no crop."""
        s = request.sampling
        projection = self.pipe.text_encoder_2.config.projection_dim
        expected = self.pipe.unet.config.projection_class_embeddings_input_dim
        ids = [s.height, s.width, 0, 0, s.height, s.width]
        if self.pipe.unet.config.addition_time_embed_dim * len(ids) + projection != expected:
            raise ConfigError(f"StableDiffusionXLPipeline: unet.projection_class_embeddings_input_dim={expected} does "
                              f"not fit {len(ids)} time ids and a pooled projection of {projection}")
        return torch.tensor([ids] * s.num_outputs, dtype=dtype, device=self.device)

    def fused_embeddings(self, requests: list[DiffusionRequest]) -> dict[str, torch.Tensor | None]:
        """Each request's own encoding (``encode``), concatenated in row order, as the pipeline's keywords."""
        encoded = [self.encode(r) for r in requests]
        names = ("prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds", "negative_pooled_prompt_embeds")
        return {name: None if encoded[0][i] is None else torch.cat([e[i] for e in encoded])
                for i, name in enumerate(names)}

    # -- request mode: one pipeline call, per-request embeddings -------------------------------------------
    def run_batch(self, requests: list[DiffusionRequest]) -> dict[str, np.ndarray]:
        cfg_rows = 2 if self.do_cfg(requests[0]) else 1     # the UNet's [uncond rows; cond rows]
        embeddings = self.fused_embeddings(requests)        # (each request's text-encoder rows set in encode)
        with self.lora_rows("unet", [(r, r.sampling.num_outputs) for r in requests], repeat=cfg_rows):
            if requests[0].edit is not None:   # img2img, inpaint
                return self.run_edit_batch(requests, embeddings)
            return self.call_pipeline(requests, **embeddings)

    # -- step contract: the same math as StableDiffusionXLPipeline.__call__, one step at a time -----------
    def prepare_encode(self, request: DiffusionRequest) -> StepRequestState:
        s, pipe, n = request.sampling, self.pipe, request.sampling.num_outputs
        embeds, negative, pooled, negative_pooled = self.encode(request)
        time_ids = self.time_ids(request, embeds.dtype)
        do_cfg = self.do_cfg(request)
        scheduler = self.noise_scheduler_for(s.num_inference_steps)
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(0)
        generators = self.generators([request])
        shape = (n, pipe.unet.config.in_channels, s.height // self.vae_scale_factor, s.width // self.vae_scale_factor)
        latents = randn_tensor(shape, generator=generators, device=self.device, dtype=embeds.dtype)
        if do_cfg:        # unconditional rows first (SDXL's order)
            cond = {"embeds": torch.cat([negative, embeds]), "text_embeds": torch.cat([negative_pooled, pooled]),
                    "time_ids": torch.cat([time_ids, time_ids])}
        else:
            cond = {"embeds": embeds, "text_embeds": pooled, "time_ids": time_ids}
        state = StepRequestState(request, scheduler, latents * scheduler.init_noise_sigma, do_cfg, cond=cond,
                                 step_kwargs=pipe.prepare_extra_step_kwargs(generators, 0.0))
        if request.edit is not None:       # img2img, inpaint: latents from the image
            self.prepare_edit(request, state)
        return state

    def denoise_step(self, states: list[StepRequestState]) -> list[torch.Tensor]:
        rows, timesteps = self.model_inputs(states)
        added = {key: torch.cat([st.cond[key] for st in states]) for key in ("text_embeds", "time_ids")}
        with self.lora_rows("unet", [(st.request, len(r)) for st, r in zip(states, rows, strict=True)]):
            noise = self.pipe.unet(torch.cat(rows), timesteps,
                                   encoder_hidden_states=torch.cat([st.cond["embeds"] for st in states]),
                                   added_cond_kwargs=added, return_dict=False)[0]
        return self.guided_per_request(states, noise, rows)
