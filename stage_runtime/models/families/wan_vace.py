"""Wan VACE (WanVACEPipeline): video-to-video on Wan 2.1 (and Wan 2.2's two experts where a folder has them) from a
source/control video, an optional mask video and optional reference images (``request.video_input``, decoded at the
edge), all optional: without them it is text-to-video through the VACE branch (a zero video, an all-ones mask).

The conditioning is prepared once per request exactly as ``__call__`` does, by the pipeline's own steps::

    preprocess_conditions   the frames at the video's size (the request's, admission made them equal), the mask
                            in [0, 1] (ones without one), each reference letterboxed on a white canvas of that size
    prepare_video_latents   [VAE(video x (1 - mask)) ‖ VAE(video x mask)] (32 ch), each reference's latents
                            (and zeros) one more latent frame before the video's (``argmax``: no randomness)
    prepare_masks           the mask folded 8 x 8 into 64 channels at the latent grid, zero frames for references
    prepare_latents         the noise over num_frames + 4 x refs frames (the request's generators)

Every forward gives the transformer ``control_hidden_states`` = [latents ‖ mask] (96 ch) with the row's request,
and ``control_hidden_states_scale`` (1.0 per VACE layer: diffusers' default ``conditioning_scale``); the decoded
latents drop the reference frames. Everything else is WanAdapter's: one forward per step over every scheduled
request's ``[cond x n; uncond x n]`` rows, the experts and their guidance. Both keys add ``video_input`` (the
reference count: each one more latent frame); height, width and frames are there already.

LoRA is WanAdapter's, per row on the experts (WanLoraLoaderMixin's components): a Wan LoRA adapts the Wan blocks,
one trained on VACE its VACE blocks too (every row of the control branch is the same row of the batch).

Sequence parallel is Wan's installer (models/families/wan_ulysses.py), which shards the control branch alike: each
VACE block's control tokens are my chunk of the video's, so its hint is added to my chunk of the Wan block's output.

Not served here, said where asked: the block cache (a skipped block would skip its control hint).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from PIL import Image

from stage_runtime.models.step_state import StepRequestState
from stage_runtime.models.families.wan import WanAdapter, WanExperts
from stage_runtime.request import DiffusionRequest
from stage_runtime.video_request import MAX_REFERENCE_IMAGES

CONDITIONING_SCALE = 1.0          # WanVACEPipeline.__call__'s default, on every VACE layer


class WanVACEExperts(WanExperts):
    """WanExperts whose forward also takes each row's control latents (split with the rows, as every per-row input)
    and gives every expert the per-layer control scale (not a row input: never split by CFG parallel)."""

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                expert_timestep: torch.Tensor, control_hidden_states: torch.Tensor) -> torch.Tensor:
        inputs = {"hidden_states": hidden_states, "timestep": timestep, "encoder_hidden_states": encoder_hidden_states,
                  "control_hidden_states": control_hidden_states}
        layers = len(self.transformer.config.vace_layers)
        scale = torch.full((layers,), CONDITIONING_SCALE, dtype=self.transformer.dtype, device=hidden_states.device)
        return self.run_routes(inputs, self.expert_routes(expert_timestep), control_hidden_states_scale=scale)


class WanVACEAdapter(WanAdapter):
    pipeline_classes = ("WanVACEPipeline",)
    tiny_kinds = ("wan-vace",)
    supports_block_cache = False
    request_key_fields = (*WanAdapter.request_key_fields, "video_input")
    step_key_fields = (*WanAdapter.step_key_fields, "video_input")

    def __init__(self, pipeline, device: torch.device):
        super().__init__(pipeline, device)
        self.experts = WanVACEExperts(pipeline.transformer, pipeline.transformer_2, self.experts.boundary)

    def family_facts(self) -> dict:
        return {**super().family_facts(), "video_input": True, "max_reference_images": MAX_REFERENCE_IMAGES}

    def prepare_video_latents(self, request: DiffusionRequest) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The noise and the control latents [inactive ‖ reactive ‖ mask], as ``__call__`` prepares them."""
        s, pipe, given = request.sampling, self.pipe, request.video_input
        frames = None if given is None else given.frames
        mask = None if given is None else given.mask
        refs = [] if given is None else [Image.fromarray(np.asarray(im), mode="RGB") for im in given.references]
        video, masks, references = pipe.preprocess_conditions(
            None if frames is None else _pictures(frames), None if mask is None else _pictures(mask), refs or None,
            1, s.height, s.width, s.num_frames, torch.float32, self.device)
        control = pipe.prepare_video_latents(video, masks, references, None, self.device)
        control = torch.cat([control, pipe.prepare_masks(masks, references, None)], dim=1)
        extra = len(references[0]) * pipe.vae_scale_factor_temporal
        latents = pipe.prepare_latents(s.num_outputs, pipe.transformer.config.in_channels, s.height, s.width,
                                       s.num_frames + extra, torch.float32, self.device, self.generators([request]))
        return latents, {"control": control.to(pipe.transformer.dtype), "references": len(references[0])}

    def extra_rows(self, states: list[StepRequestState], rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"control_hidden_states": torch.cat(
            [st.cond["control"].expand(len(r), -1, -1, -1, -1) for st, r in zip(states, rows, strict=True)])}

    def post_decode(self, state: StepRequestState) -> np.ndarray:
        """WanAdapter's decode of the latents without the reference frames (``latents[:, :, refs:]``)."""
        return super().post_decode(replace(state, latents=state.latents[:, :, state.cond["references"]:]))


def _pictures(frames: np.ndarray) -> list[Image.Image]:
    """uint8 (F, H, W, 3) → the list of PIL frames ``__call__`` takes."""
    return [Image.fromarray(np.asarray(frame), mode="RGB") for frame in frames]
