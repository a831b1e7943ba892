"""FLUX.1 pipelines (FluxPipeline): an MMDiT with double-stream then single-stream blocks, CLIP (pooled)
+ T5 (sequence) prompts, 2x2-packed latents with rotary position ids, flow matching with dynamic shift.

FLUX.1 [dev] is guidance-distilled: ``guidance_scale`` enters the transformer as an embedding (one value
per row) and there is no unconditional pass, hence no CFG-parallel. FLUX.1 [schnell] has no guidance
embedding at all (``guidance: none``; 4 steps). Ulysses shards the joint text+image sequence
(stage_runtime.distributed.ulysses_joint).

Compatibility: a denoiser forward needs one latent shape (height, width: image tokens, position ids)
and one text length (``max_sequence_length``, fixed per model); timesteps and guidance are per row, so
requests of different step counts and guidance scales share ticks. A pipeline call takes one step count
and one guidance scale.

Refusals (``PipelineAdapter.check_request``, by ``guidance``): a negative prompt (diffusers' FluxPipeline
uses one only for true CFG, ``true_cfg_scale > 1``, which is not served: it would be ignored) and, on
[schnell], a guidance scale (no guidance embedding: ignored).

img2img: a generation folder serves it too, ``FluxImg2ImgPipeline`` built with ``from_pipe`` over the SAME
modules (no weight copied). Request mode calls it; step mode repeats its math:

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

from stage_runtime.models.adapter import PipelineAdapter
from stage_runtime.models.edit_images import pil_image
from stage_runtime.models.flow_match import flux_sigmas, request_flow_scheduler
from stage_runtime.models.step_contract import StepContract
from stage_runtime.models.step_state import StepRequestState
from stage_runtime.request import DiffusionRequest

T5_MAX_TOKENS = 512          # FluxPipeline's default (and limit) for max_sequence_length
FLUX_MAX_SHIFT = 1.15


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
        generators = self.generators(requests)         # the encode draws from them first, then the call
        return self.call_pipeline(requests, self._img2img_pipeline(), generators,
                                  **self.prompt_kwargs(requests, negative=False),
                                  image=self.edit_image_latents(requests, generators),
                                  strength=requests[0].edit.strength, max_sequence_length=self.max_sequence_length())

    # -- step mode ----------------------------------------------------------------------------------------
    def prepare_edit(self, request: DiffusionRequest, state: StepRequestState) -> None:
        """Turn a fresh text-to-image state into the edit's: latents from the image, the schedule's tail.

        Fresh generators: FluxImg2ImgPipeline draws the image's latent sample first, then the noise (the
        text-to-image latents the generation path drew are discarded)."""
        s, edit, n = request.sampling, request.edit, request.sampling.num_outputs
        img2img, scheduler = self._img2img_pipeline(), state.noise_scheduler
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


class FluxAdapter(FluxEditMixin, StepContract, PipelineAdapter):
    pipeline_classes = ("FluxPipeline",)
    tiny_kinds = ("flux",)
    default_steps = 28
    default_guidance = 3.5
    guidance = "distilled"
    parallel_kinds = frozenset({"ulysses", "ring", "tp"})
    sequence_attention = "joint"
    block_lists = ("transformer_blocks", "single_transformer_blocks")
    supports_block_cache = True          # models.block_cache: first block, then the rest or its residual
    lora_components = ("transformer", "text_encoder")      # as FluxPipeline.load_lora_weights (CLIP, not T5)
    request_key_fields = ("height", "width", "num_inference_steps", "guidance_scale")
    step_key_fields = ("height", "width")

    def __init__(self, pipeline, device):
        super().__init__(pipeline, device)
        if not self.pipe.transformer.config.guidance_embeds:      # FLUX.1 [schnell]
            self.guidance, self.default_guidance, self.default_steps = "none", 0.0, 4

    def default_size(self) -> tuple[int, int]:
        side = self.pipe.vae.config.sample_size
        side = side[0] if isinstance(side, (list, tuple)) else side
        return int(side), int(side)

    def size_multiple(self) -> int:
        return self.vae_scale_factor * 2            # the VAE's factor, then 2x2 packing

    def max_sequence_length(self) -> int:
        return min(T5_MAX_TOKENS, int(self.pipe.tokenizer_2.model_max_length))

    def parallel_refusal(self, kind: str) -> str | None:
        if kind == "cfg":
            return ("FLUX.1 is guidance-distilled: guidance_scale is an embedding inside the single transformer "
                    "pass of each step, there is no unconditional pass to put on another rank")
        return None

    # -- request mode ----------------------------------------------------------------------------------
    def run_batch(self, requests: list[DiffusionRequest]) -> dict[str, np.ndarray]:
        with self.batch_lora_rows(requests):             # one row per image in both components
            if requests[0].edit is not None:              # img2img (the same rows)
                return self.run_edit_batch(requests)
            return self.call_pipeline(requests, **self.prompt_kwargs(requests, negative=False),
                                      max_sequence_length=self.max_sequence_length())

    def encode_request_prompt(self, request: DiffusionRequest):
        """(T5 embeds [n, seq, d], pooled CLIP [n, d], text ids [seq, 3]) for the request's n images, its LoRA rows set."""
        n = request.sampling.num_outputs
        with self.batch_lora_rows([request], components=self.encoder_lora_components):
            return self.pipe.encode_prompt(prompt=[request.prompt] * n, prompt_2=None, device=self.device,
                                           num_images_per_prompt=1, max_sequence_length=self.max_sequence_length())

    # -- step contract: the same math as FluxPipeline.__call__, one step at a time -----------------------
    def prepare_encode(self, request: DiffusionRequest) -> StepRequestState:
        s, pipe, n = request.sampling, self.pipe, request.sampling.num_outputs
        embeds, pooled, text_ids = self.encode_request_prompt(request)
        channels = pipe.transformer.config.in_channels // 4
        latents, image_ids = pipe.prepare_latents(n, channels, s.height, s.width, embeds.dtype, self.device,
                                                  self.generators([request]))
        scheduler = request_flow_scheduler(pipe.scheduler, s.num_inference_steps, self.device, latents.shape[1],
                                           FLUX_MAX_SHIFT, flux_sigmas(s.num_inference_steps, pipe.scheduler.config))
        cond = {"embeds": embeds, "pooled": pooled, "text_ids": text_ids, "image_ids": image_ids}
        if pipe.transformer.config.guidance_embeds:
            cond["guidance"] = torch.full([n], s.guidance_scale, device=self.device, dtype=torch.float32)
        state = StepRequestState(request, scheduler, latents, do_cfg=False, cond=cond)
        if request.edit is not None:       # img2img: latents from the image
            self.prepare_edit(request, state)
        return state

    def denoise_step(self, states: list[StepRequestState]) -> list[torch.Tensor]:
        rows = [st.latents for st in states]
        timesteps = torch.cat([st.timestep.expand(len(st.latents)).to(st.latents.dtype) for st in states])
        guidance = (torch.cat([st.cond["guidance"] for st in states]) if "guidance" in states[0].cond else None)
        first = states[0].cond            # same size and text length: the position ids are shared
        with self.lora_rows("transformer", [(st.request, len(st.latents)) for st in states]):
            noise = self.pipe.transformer(
                hidden_states=torch.cat(rows), timestep=timesteps / 1000, guidance=guidance,
                pooled_projections=torch.cat([st.cond["pooled"] for st in states]),
                encoder_hidden_states=torch.cat([st.cond["embeds"] for st in states]),
                txt_ids=first["text_ids"], img_ids=first["image_ids"], joint_attention_kwargs={},
                return_dict=False)[0]
        return self.split_rows(noise, rows)

    def decode_latents(self, state: StepRequestState) -> torch.Tensor:
        s = state.request.sampling
        return self.pipe._unpack_latents(state.latents, s.height, s.width, self.pipe.vae_scale_factor)
