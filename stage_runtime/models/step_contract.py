"""The four-method step contract (step mode), composed from a pipeline's diffusers components.

    prepare_encode(request) -> state     once per request: prompt/class encoding, latents from the
                                         request's generators, a per-request copy of the noise scheduler
    denoise_step(states) -> [pred]       ONE batched denoiser forward for every scheduled request, each at
                                         its own timestep; guidance applied; predictions sliced per request
    noise_step(state, pred)              latent update for one step (the noise scheduler's ``step``); the
                                         only place step_index advances
    post_decode(state) -> uint8 images   VAE decode (on completion, or for a preview); the default decodes
                                         ``decode_latents(state)`` with the pipeline's VAE and image processor
    decode(state) -> images | Decoded    the finished request's output: ``post_decode``'s pixels, with the sound
                                         decoded beside them for a family that makes it (LTX-2)

Each request keeps its own generator, scheduler copy and progress, so its image equals what the
pipeline's ``__call__`` gives it alone, whatever it is batched with and whenever it joined.
"""

from __future__ import annotations

import copy
from abc import abstractmethod
from typing import ClassVar

import numpy as np
import torch

from stage_runtime.outputs import Decoded
from stage_runtime.request import DiffusionRequest
from stage_runtime.models.step_state import StepRequestState


class StepContract:
    supports_step_execution: ClassVar[bool] = True

    @abstractmethod
    def prepare_encode(self, request: DiffusionRequest) -> StepRequestState:
        """Encode once and create the request's step state."""

    @abstractmethod
    def denoise_step(self, states: list[StepRequestState]) -> list[torch.Tensor]:
        """One denoiser forward for all states → one guided prediction per state, in order."""

    def post_decode(self, state: StepRequestState) -> np.ndarray:
        """Decode the state's current latents → uint8 (num_outputs, H, W, 3): un-normalise them with the VAE's
        scaling (and shift) factor, decode, post-process as the pipeline does."""
        vae = self.pipe.vae
        latents = self.decode_latents(state) / vae.config.scaling_factor
        shift = getattr(vae.config, "shift_factor", None)
        image = vae.decode(latents if shift is None else latents + shift, return_dict=False)[0]
        return self.to_uint8(self.pipe.image_processor.postprocess(image, output_type="np"))

    def decode(self, state: StepRequestState) -> np.ndarray | Decoded:
        """A finished state's output (a preview is ``post_decode`` alone): pixels, or pixels and sound."""
        return self.post_decode(state)

    def decode_latents(self, state: StepRequestState) -> torch.Tensor:
        """The latents the VAE decodes (a family with packed latents unpacks them here)."""
        return state.latents

    def noise_step(self, state: StepRequestState, noise_pred: torch.Tensor) -> None:
        state.latents = state.noise_scheduler.step(noise_pred, state.timestep, state.latents, **state.step_kwargs,
                                                   return_dict=False)[0]
        state.step_index += 1

    def run_step_loop(self, requests: list[DiffusionRequest]) -> dict[str, np.ndarray | Decoded]:
        """Request mode as the step loop, to the end, for a whole wave (its requests share their step count):
        for a family whose pipeline calls its denoiser more than once per step (a pass per CFG branch), so
        that both modes make ONE denoiser call per step over every row."""
        states = [self.prepare_encode(r) for r in requests]
        while not states[0].finished:
            for state, pred in zip(states, self.denoise_step(states), strict=True):
                self.noise_step(state, pred)
        return {st.request_id: self.decode(st) for st in states}

    # -- shared helpers --------------------------------------------------------------------------------
    def noise_scheduler_for(self, num_steps: int):
        """A private copy of the pipeline's noise scheduler with this request's timesteps."""
        scheduler = copy.deepcopy(self.pipe.scheduler)
        scheduler.set_timesteps(num_steps, device=self.device)
        return scheduler

    @staticmethod
    def model_inputs(states: list[StepRequestState]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Each state's (CFG-doubled, scaled) latent rows and the per-row timesteps of the fused forward."""
        rows, timesteps = [], []
        for st in states:
            latents = torch.cat([st.latents] * 2) if st.do_cfg else st.latents
            rows.append(st.noise_scheduler.scale_model_input(latents, st.timestep))
            timesteps.append(st.timestep.reshape(1).expand(len(latents)))
        return rows, torch.cat(timesteps)

    @staticmethod
    def guided(uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
        """Classifier-free guidance: the unconditional prediction moved ``scale`` times towards the conditional."""
        return uncond + scale * (cond - uncond)

    @staticmethod
    def split_rows(output: torch.Tensor, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(torch.split(output, [len(r) for r in rows]))

    @classmethod
    def guided_per_request(cls, states: list[StepRequestState], output: torch.Tensor,
                           rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """One fused forward's output → one prediction per state: its rows, guided when it runs CFG
        (rows ``[uncond; cond]``, each half ``num_outputs`` images)."""
        preds = []
        for st, pred in zip(states, cls.split_rows(output, rows), strict=True):
            if st.do_cfg:
                uncond, text = pred.chunk(2)
                pred = cls.guided(uncond, text, st.request.sampling.guidance_scale)
            preds.append(pred)
        return preds
