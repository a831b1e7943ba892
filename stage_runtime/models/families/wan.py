"""Wan (WanPipeline): Wan 2.1, Wan 2.2 A14B (two experts) and Wan 2.2 TI2V-5B — text to video, and TI2V-5B image to
video with a first frame; WanImageToVideoPipeline below (Wan 2.1 I2V, Wan 2.2 I2V A14B).

A 3-D DiT over patchified video latents, a T5 prompt (padded to ``max_sequence_length`` with zeros), flow
matching, classifier-free guidance. diffusers calls the transformer twice per step (prompt, then negative
prompt); here one step is ONE denoiser forward over every scheduled request's rows, ``[cond x n; uncond x n]``
when guided, so request mode runs the step loop to the end for its wave (as Qwen-Image) and both modes make one
denoiser call per step (the runner's step clock). Per row:

    timestep    t (Wan 2.1/2.2), or t per latent token (TI2V-5B: ``expand_timesteps``; 0 on a first frame's)
    input       the noisy latents; TI2V-5B with a picture: its first latent frame in place of the noise's
    expert      Wan 2.2 A14B: ``transformer`` while t >= boundary_ratio x num_train_timesteps (high noise,
                guidance_scale), then ``transformer_2`` (low noise, guidance_scale_2); ``WanExperts`` splits
                one forward's rows between them, so requests on either side of the boundary share ticks
    guided      uncond + g * (cond - uncond), g the row's expert's scale

Frames are ``4k + 1`` (the VAE's temporal factor): any other count is refused at admission, never rounded
as diffusers does; height and width are multiples of the VAE's spatial factor x the patch size.

Per-row features wrap each expert's call with the rows routed to it (models.routed): LoRA (``transformer.`` keys
on ``transformer``, ``transformer_2.`` keys on the low-noise expert, as WanLoraLoaderMixin) and the block cache
(per expert: a residual never crosses the boundary). Layerwise offload splits each expert into its blocks.
"""

from __future__ import annotations

import contextlib
import inspect

import numpy as np
import torch
from PIL import Image

from stage_runtime.distributed.ulysses_joint import joint_attention_heads
from stage_runtime.models.adapter import PipelineAdapter
from stage_runtime.models.families.wan_ulysses import enable_wan_sequence_parallel
from stage_runtime.models.routed import RoutedDenoiser
from stage_runtime.models.step_contract import StepContract
from stage_runtime.models.step_state import StepRequestState
from stage_runtime.request import DiffusionRequest

MAX_SEQUENCE_LENGTH = 512          # WanPipeline.__call__'s default: every prompt is padded to it
DEFAULT_FPS = 16


class WanExperts(RoutedDenoiser):
    """The denoiser of one step: ``transformer`` alone (Wan 2.1, TI2V), or Wan 2.2's two experts, each row sent
    to the one its timestep belongs to. One call per step whichever experts run (the step clock's module); per-row
    features wrap each expert's call with its rows (``RoutedDenoiser.around_each``)."""

    part_names = ("transformer", "transformer_2")

    def __init__(self, transformer: torch.nn.Module, transformer_2: torch.nn.Module | None, boundary: float | None):
        super().__init__()
        self.transformer, self.transformer_2, self.boundary = transformer, transformer_2, boundary

    def high_noise(self, expert_timestep: torch.Tensor) -> torch.Tensor:
        """Per row: True where ``transformer`` (the high-noise expert) runs it."""
        if self.boundary is None:
            return torch.ones_like(expert_timestep, dtype=torch.bool)
        return expert_timestep >= self.boundary

    def expert_routes(self, expert_timestep: torch.Tensor) -> list[tuple[str, torch.Tensor | None]]:
        """Which expert runs which rows: one expert for all of them, or the high-noise rows and the others."""
        high = self.high_noise(expert_timestep)
        if bool(high.all()) or self.transformer_2 is None:
            return [("transformer", None)]
        if not bool(high.any()):
            return [("transformer_2", None)]
        return [("transformer", high.nonzero().flatten()), ("transformer_2", (~high).nonzero().flatten())]

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                expert_timestep: torch.Tensor, encoder_hidden_states_image: torch.Tensor | None = None) -> torch.Tensor:
        inputs = {"hidden_states": hidden_states, "timestep": timestep, "encoder_hidden_states": encoder_hidden_states,
                  "encoder_hidden_states_image": encoder_hidden_states_image}
        return self.run_routes(inputs, self.expert_routes(expert_timestep))


class WanAdapter(StepContract, PipelineAdapter):
    pipeline_classes = ("WanPipeline",)
    tiny_kinds = ("wan", "wan22", "wan-ti2v")
    refuses_long_prompts = True          # a prompt the T5 encoder would cut is a 400 (engine/prompt_length)
    default_steps = 50
    default_guidance = 5.0
    parallel_kinds = frozenset({"cfg", "ulysses", "ring"})
    sequence_parallel = staticmethod(enable_wan_sequence_parallel)   # the video tokens; text whole on every rank
    low_cpu_mem_usage = None                                  # its norms are kept in float32 (diffusers' rule)
    block_lists = ("blocks",)                      # each expert's WanTransformerBlocks (offload, block cache)
    supports_block_cache = True        # models.block_cache, per expert: a residual never crosses the boundary
    request_mode_step_loop = True
    # LoRA on the experts, as WanLoraLoaderMixin: ``transformer.`` keys adapt transformer (its load_lora_weights),
    # ``transformer_2.`` keys Wan 2.2's low-noise expert (load_lora_weights(..., load_into_transformer_2=True)).
    lora_components = ("transformer", "transformer_2")
    request_key_fields = ("height", "width", "num_frames", "num_inference_steps", "guidance_scale",
                          "guidance_scale_2")
    step_key_fields = ("height", "width", "num_frames")     # timesteps, guidance and experts are per row

    def __init__(self, pipeline, device: torch.device):
        super().__init__(pipeline, device)
        ratio = pipeline.config.boundary_ratio
        boundary = None if ratio is None else ratio * pipeline.scheduler.config.num_train_timesteps
        self.experts = WanExperts(pipeline.transformer, pipeline.transformer_2, boundary)
        if pipeline.transformer_2 is None:                 # ModelInfo says what this folder's adapters may target
            self.lora_components = ("transformer",)

    def num_attention_heads(self) -> int:             # WanAttention: no diffusers Attention
        return joint_attention_heads(self.denoiser)

    @property
    def denoiser(self) -> torch.nn.Module:
        return self.experts

    def parallel_refusal(self, kind: str) -> str | None:
        if kind == "tp":
            return ("distributed/tensor_parallel.py shards diffusers' Attention layers, and WanAttention "
                    "RMS-normalises q and k across all heads at once (rms_norm_across_heads), which a rank holding "
                    "a share of the heads cannot do alone")
        return None

    @property
    def vae_scale_factor(self) -> int:
        return int(self.pipe.vae_scale_factor_spatial)

    def size_multiple(self) -> int:
        return self.vae_scale_factor * self.pipe.transformer.config.patch_size[1]

    def default_size(self) -> tuple[int, int]:
        params = inspect.signature(type(self.pipe).__call__).parameters
        return int(params["height"].default), int(params["width"].default)

    def max_sequence_length(self) -> int:
        return MAX_SEQUENCE_LENGTH

    def family_facts(self) -> dict:
        frames = inspect.signature(type(self.pipe).__call__).parameters["num_frames"].default
        first_frame = {"reference": "optional"} if self.pipe.config.get("expand_timesteps") else {}     # TI2V-5B
        return {"frame_rule": (int(self.pipe.vae_scale_factor_temporal), 1), "default_frames": int(frames),
                "default_fps": DEFAULT_FPS, "takes_guidance_2": self.experts.boundary is not None, **first_frame}

    # -- request mode: the step loop, to the end, for the whole wave -------------------------------------
    def run_batch(self, requests: list[DiffusionRequest]) -> dict[str, np.ndarray]:
        return self.run_step_loop(requests)

    # -- step contract: WanPipeline.__call__, one step at a time ------------------------------------------
    def prepare_encode(self, request: DiffusionRequest) -> StepRequestState:
        s, pipe, n = request.sampling, self.pipe, request.sampling.num_outputs
        do_cfg = s.guidance_scale > 1
        embeds, negative = pipe.encode_prompt(
            prompt=[request.prompt] * n, negative_prompt=[s.negative_prompt or ""] * n, do_classifier_free_guidance=do_cfg,
            num_videos_per_prompt=1, max_sequence_length=MAX_SEQUENCE_LENGTH, device=self.device)
        dtype = pipe.transformer.dtype
        embeds = embeds.to(dtype) if not do_cfg else torch.cat([embeds, negative]).to(dtype)   # [cond; uncond]
        scheduler = self.noise_scheduler_for(s.num_inference_steps)
        scheduler.set_begin_index(0)
        latents, cond = self.prepare_video_latents(request)
        return StepRequestState(request, scheduler, latents, do_cfg, cond={"embeds": embeds, **cond})

    def prepare_video_latents(self, request: DiffusionRequest) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The initial noise from the request's generators, and what else conditions its forwards: nothing for text to
        video; TI2V-5B with a picture, its first frame (:meth:`first_frame_latents`)."""
        s = request.sampling
        if request.reference is not None:
            return self.first_frame_latents(request)
        return self.pipe.prepare_latents(s.num_outputs, self.pipe.transformer.config.in_channels, s.height, s.width,
                                         s.num_frames, torch.float32, self.device, self.generators([request])), {}

    def first_frame_latents(self, request: DiffusionRequest) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """TI2V-5B image-to-video, as ``WanImageToVideoPipeline`` runs it over the same modules with
        ``expand_timesteps``: the picture resized to the request's size and VAE-encoded (the first latent frame),
        the same noise as text to video, and a mask that is 0 on the first latent frame. Every forward sees the
        first frame in place of its noise, at timestep 0 on its tokens; the decoded latents keep it."""
        from diffusers import WanImageToVideoPipeline

        s, pipe = request.sampling, self.pipe
        i2v = WanImageToVideoPipeline(**{k: v for k, v in pipe.components.items() if k != "image_processor"},
                                      boundary_ratio=pipe.config.boundary_ratio, expand_timesteps=True)
        image = Image.fromarray(request.reference, mode="RGB")
        pixels = i2v.video_processor.preprocess(image, height=s.height, width=s.width).to(self.device, torch.float32)
        latents, condition, mask = i2v.prepare_latents(
            pixels, s.num_outputs, pipe.vae.config.z_dim, s.height, s.width, s.num_frames, torch.float32,
            self.device, self.generators([request]))
        return latents, {"condition": condition, "first_frame_mask": mask}

    def with_first_frame(self, state: StepRequestState, latents: torch.Tensor) -> torch.Tensor:
        mask = state.cond.get("first_frame_mask")
        return latents if mask is None else (1 - mask) * state.cond["condition"] + mask * latents

    def model_input(self, state: StepRequestState) -> torch.Tensor:
        """One state's rows of the transformer's ``hidden_states`` (before the CFG doubling)."""
        return self.with_first_frame(state, state.latents)

    def extra_rows(self, states: list[StepRequestState], rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """More per-row inputs of the forward (image-to-video: the reference image's CLIP tokens)."""
        return {}

    def timesteps_of(self, state: StepRequestState, rows: int) -> torch.Tensor:
        """The transformer's timestep input for ``rows`` rows of this state: t per row, or t per latent token
        (TI2V-5B's ``expand_timesteps``; every token of a text-to-video latent is at t)."""
        t = state.timestep
        if not self.pipe.config.get("expand_timesteps"):
            return t.expand(rows)
        mask = state.cond.get("first_frame_mask")
        if mask is not None:                         # a first frame: its tokens at 0 (the pipeline's own product)
            return (mask[0][0][:, ::2, ::2] * t).flatten().unsqueeze(0).expand(rows, -1)
        frames, height, width = state.latents.shape[2:]
        tokens = frames * ((height + 1) // 2) * ((width + 1) // 2)
        return torch.full((rows, tokens), float(t), dtype=torch.float32, device=state.latents.device)

    def denoise_step(self, states: list[StepRequestState]) -> list[torch.Tensor]:
        dtype = self.pipe.transformer.dtype
        rows = [torch.cat([self.model_input(st)] * 2) if st.do_cfg else self.model_input(st) for st in states]
        with self.expert_lora_rows(states, rows):
            noise = self.denoiser(
                **self.extra_rows(states, rows), hidden_states=torch.cat(rows).to(dtype),
                timestep=torch.cat([self.timesteps_of(st, len(r)) for st, r in zip(states, rows, strict=True)]),
                encoder_hidden_states=torch.cat([st.cond["embeds"] for st in states]),
                expert_timestep=torch.cat([st.timestep.reshape(1).expand(len(r))
                                           for st, r in zip(states, rows, strict=True)]))
        preds = []
        for st, pred in zip(states, self.split_rows(noise, rows), strict=True):
            if st.do_cfg:
                cond, uncond = pred.chunk(2)
                s, high = st.request.sampling, bool(self.experts.high_noise(st.timestep.reshape(1))[0])
                scale = s.guidance_scale if high or s.guidance_scale_2 is None else s.guidance_scale_2
                pred = self.guided(uncond, cond, scale)
            preds.append(pred)
        return preds

    def expert_lora_rows(self, states: list[StepRequestState], rows: list[torch.Tensor]):
        """Around each expert's call, its LoRA row plan: the rows routed to it, each with its request's adapters
        (a no-op without LoRA)."""
        if self.loras is None:
            return contextlib.nullcontext()
        sets = [st.request.sampling.loras for st, r in zip(states, rows, strict=True) for _ in range(len(r))]

        def wrap(part: str, keep: torch.Tensor | None):
            local = self.experts.on_local(sets)            # a CFG-parallel rank runs some of the rows
            return self.loras.rows(part, local if keep is None else [local[i] for i in keep.tolist()])
        return self.experts.around_each(wrap)

    def post_decode(self, state: StepRequestState) -> np.ndarray:
        """uint8 (num_outputs, F, H, W, 3): un-normalised by the VAE's latent mean and std, decoded, as the
        pipeline's video processor gives them."""
        vae = self.pipe.vae
        latents = self.with_first_frame(state, state.latents).to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean, device=latents.device, dtype=latents.dtype).view(shape)
        std = torch.tensor(vae.config.latents_std, device=latents.device, dtype=latents.dtype).view(shape)
        video = vae.decode(latents / (1.0 / std) + mean, return_dict=False)[0]          # as diffusers scales
        return self.to_uint8(self.pipe.video_processor.postprocess_video(video, output_type="np"))


class WanImageToVideoAdapter(WanAdapter):
    """WanImageToVideoPipeline (Wan 2.1 I2V, and Wan 2.2 I2V A14B without the CLIP image encoder): the video starts
    from the request's reference image. Each forward's hidden states are [noisy latents ‖ first-frame mask (4 ch)
    ‖ the image's VAE latents with the other frames zero] on the channel axis; with an image encoder the CLIP
    tokens of the image join the text in cross-attention (``encoder_hidden_states_image``). The image is
    resized to the request's size by the pipeline's video processor, as diffusers does. Wan's parallelism
    fits as is: CFG splits the image tokens with the rows, Ulysses and ring shard the video tokens of the
    self-attention while the cross-attention's image and text tokens stay whole on every rank."""

    pipeline_classes = ("WanImageToVideoPipeline",)
    tiny_kinds = ("wan-i2v", "wan22-i2v")

    def __init__(self, pipeline, device: torch.device):
        super().__init__(pipeline, device)
        self.first_frame = bool(pipeline.config.expand_timesteps)     # TI2V-5B saved as this class: WanAdapter's path

    def family_facts(self) -> dict:
        return {**super().family_facts(), "reference": "required"}

    def prepare_video_latents(self, request: DiffusionRequest) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.first_frame:
            return self.first_frame_latents(request)
        s, pipe = request.sampling, self.pipe
        image = Image.fromarray(request.reference, mode="RGB")
        cond = {}
        if pipe.transformer.config.image_dim is not None:            # Wan 2.1 I2V: the CLIP image tokens
            cond["image_embeds"] = pipe.encode_image(image, self.device).to(pipe.transformer.dtype)
        pixels = pipe.video_processor.preprocess(image, height=s.height, width=s.width).to(self.device, torch.float32)
        latents, cond["condition"] = pipe.prepare_latents(
            pixels, s.num_outputs, pipe.vae.config.z_dim, s.height, s.width, s.num_frames, torch.float32,
            self.device, self.generators([request]))
        return latents, cond

    def model_input(self, state: StepRequestState) -> torch.Tensor:
        if self.first_frame:
            return self.with_first_frame(state, state.latents)
        return torch.cat([state.latents, state.cond["condition"]], dim=1)

    def extra_rows(self, states: list[StepRequestState], rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        if "image_embeds" not in states[0].cond:
            return {}
        return {"encoder_hidden_states_image": torch.cat(
            [st.cond["image_embeds"].expand(len(r), -1, -1) for st, r in zip(states, rows, strict=True)])}
