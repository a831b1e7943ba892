"""Qwen-Image (QwenImagePipeline): a dual-stream MMDiT over packed 2x2 latent patches, a Qwen2.5-VL text
encoder (prompt in a chat template, the template's system prefix dropped), flow matching with a dynamic
shift, and *true* CFG: the request's ``guidance_scale`` is diffusers' ``true_cfg_scale``.

diffusers calls the transformer twice per step (prompt, then negative prompt) and rescales the guided
prediction to the conditional one's norm. Here one step is ONE transformer forward over the rows of
every scheduled request, for each ``[cond x n; negative x n]`` when guided::

    rows        latents (n, L, 4C) twice, text embeds padded to the longest prompt of the tick (with a
                key mask; no mask when every row is full), timestep t / 1000 per row
    guided      comb = neg + s * (cond - neg);  pred = comb * |cond| / |comb|   (norms over channels)

Request mode runs the same loop to the end for the wave (requests of a wave share size and steps), so
both modes make one denoiser call per step — the runner's step hook counts steps — and CFG-parallel
splits true-CFG rows like any other rows. Without a negative prompt true CFG uses ``" "`` (Qwen-Image's
own usage; diffusers enables it only when a negative prompt is given). Guidance <= 1 runs unguided.

LoRA adapts the transformer (QwenImageLoraLoaderMixin; the Qwen2.5-VL encoder never): each request's rows
(prompt and negative alike) carry its adapters.
"""

from __future__ import annotations

import numpy as np
import torch

from stage_runtime.models.adapter import PipelineAdapter
from stage_runtime.models.flow_match import request_flow_scheduler
from stage_runtime.models.step_contract import StepContract
from stage_runtime.models.step_state import StepRequestState
from stage_runtime.request import DiffusionRequest

DEFAULT_NEGATIVE = " "
MAX_SEQUENCE_LENGTH = 512          # QwenImagePipeline.__call__'s default
QWEN_MAX_SHIFT = 1.15              # the dynamic shift's default top (QwenImagePipeline's calculate_shift)


class QwenImageAdapter(StepContract, PipelineAdapter):
    pipeline_classes = ("QwenImagePipeline",)
    tiny_kinds = ("qwen-image",)
    guidance = "true_cfg"                                          # guidance_scale is true_cfg_scale
    default_steps, default_guidance = 50, 4.0
    block_lists = ("transformer_blocks",)                          # the dual-stream MMDiT blocks
    parallel_kinds = frozenset({"cfg", "ulysses", "ring"})
    sequence_attention = "qwen"                                    # both streams cut, the text key mask
    lora_components = ("transformer",)                             # as QwenImageLoraLoaderMixin

    @property
    def supports_block_cache(self) -> bool:        # zero_cond_t doubles the modulation rows: not per-row
        return not getattr(self.pipe.transformer.config, "zero_cond_t", False)

    @property
    def vae_scale_factor(self) -> int:
        return int(self.pipe.vae_scale_factor)

    def size_multiple(self) -> int:
        return self.vae_scale_factor * 2            # latent pixels pack 2x2 into one token

    def default_size(self) -> tuple[int, int]:
        side = self.pipe.default_sample_size * self.vae_scale_factor
        return side, side

    def max_sequence_length(self) -> int:
        return MAX_SEQUENCE_LENGTH

    # -- request mode: the step loop, to the end, for the whole wave -------------------------------------
    def run_batch(self, requests: list[DiffusionRequest]) -> dict[str, np.ndarray]:
        return self.run_step_loop(requests)

    # -- step contract -------------------------------------------------------------------------------------
    def _encode(self, text: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, T, D) embeddings of the templated text and their (n, T) validity mask (all ones: one prompt)."""
        embeds, mask = self.pipe.encode_prompt(prompt=[text], device=self.device, num_images_per_prompt=n,
                                               max_sequence_length=MAX_SEQUENCE_LENGTH)
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return embeds, mask

    def prepare_encode(self, request: DiffusionRequest) -> StepRequestState:
        s, pipe, n = request.sampling, self.pipe, request.sampling.num_outputs
        do_cfg = s.guidance_scale > 1
        embeds, mask = self._encode(request.prompt, n)
        cond = {"embeds": embeds, "mask": mask}
        if do_cfg:
            negative = s.negative_prompt if s.negative_prompt is not None else DEFAULT_NEGATIVE
            cond["neg_embeds"], cond["neg_mask"] = self._encode(negative, n)
        latents = pipe.prepare_latents(n, pipe.transformer.config.in_channels // 4, s.height, s.width, embeds.dtype,
                                       self.device, self.generators([request]))
        scheduler = request_flow_scheduler(pipe.scheduler, s.num_inference_steps, self.device, latents.shape[1],
                                           QWEN_MAX_SHIFT, np.linspace(1.0, 1 / s.num_inference_steps,
                                                                       s.num_inference_steps))
        return StepRequestState(request, scheduler, latents, do_cfg, cond=cond)

    def latent_grid(self, state: StepRequestState) -> tuple[int, int, int]:
        """(frames, rows, columns) of packed tokens: the transformer's ``img_shapes`` entry."""
        s, factor = state.request.sampling, self.vae_scale_factor
        return 1, s.height // factor // 2, s.width // factor // 2

    def denoise_step(self, states: list[StepRequestState]) -> list[torch.Tensor]:
        latents, texts, masks, timesteps = [], [], [], []
        for st in states:
            branches = [("embeds", "mask"), ("neg_embeds", "neg_mask")] if st.do_cfg else [("embeds", "mask")]
            for embeds, mask in branches:
                latents.append(st.latents)
                texts.append(st.cond[embeds])
                masks.append(st.cond[mask])
                timesteps.append(st.timestep.reshape(1).expand(len(st.latents)))
        longest = max(t.shape[1] for t in texts)
        text = torch.cat([torch.nn.functional.pad(t, (0, 0, 0, longest - t.shape[1])) for t in texts])
        mask = torch.cat([torch.nn.functional.pad(m, (0, longest - m.shape[1])) for m in masks])
        hidden = torch.cat(latents)
        rows = [(st.request, len(st.latents) * (2 if st.do_cfg else 1)) for st in states]
        with self.lora_rows("transformer", rows):
            noise = self.pipe.transformer(
                hidden_states=hidden, timestep=torch.cat(timesteps).to(hidden.dtype) / 1000,
                encoder_hidden_states=text, encoder_hidden_states_mask=None if bool(mask.all()) else mask,
                img_shapes=[[self.latent_grid(states[0])]] * len(hidden), return_dict=False)[0]
        preds, row = [], 0
        for st in states:
            n = len(st.latents)
            pred = noise[row:row + n]
            if st.do_cfg:
                neg = noise[row + n:row + 2 * n]
                comb = neg + st.request.sampling.guidance_scale * (pred - neg)
                pred = comb * (torch.norm(pred, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
            preds.append(pred)
            row += 2 * n if st.do_cfg else n
        return preds

    def post_decode(self, state: StepRequestState) -> np.ndarray:
        vae = self.pipe.vae
        _, rows, cols = self.latent_grid(state)
        n, _, channels = state.latents.shape
        latents = state.latents.view(n, rows, cols, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
        latents = latents.reshape(n, channels // 4, 1, rows * 2, cols * 2).to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean, device=latents.device, dtype=latents.dtype).view(shape)
        std = torch.tensor(vae.config.latents_std, device=latents.device, dtype=latents.dtype).view(shape)
        image = vae.decode(latents / (1.0 / std) + mean, return_dict=False)[0][:, :, 0]   # as diffusers scales
        return self.to_uint8(self.pipe.image_processor.postprocess(image, output_type="np"))
