"""StepRequestState: one request's denoising state in step mode. Runner-owned; never crosses a process (a step
checkpoint is a copy of it in a file: models.step_checkpoint)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from stage_runtime.request import DiffusionRequest


@dataclass
class StepRequestState:
    request: DiffusionRequest
    noise_scheduler: Any                # this request's own copy of the noise scheduler (timesteps set)
    latents: torch.Tensor               # (num_outputs, C, h, w)
    do_cfg: bool
    cond: dict[str, torch.Tensor] = field(default_factory=dict)   # prompt embeds / class labels, CFG rows first
    step_kwargs: dict[str, Any] = field(default_factory=dict)     # extra kwargs for scheduler.step
    step_index: int = 0                 # steps completed; advanced only by noise_step()
    t_start: int = 0                    # an edit skips the first t_start timesteps (strength < 1)
    edit: dict[str, Any] = field(default_factory=dict)            # edit tensors (inpaint: mask, image latents, noise)
    cache: Any = None                   # its BlockCacheState (models.block_cache) when the block cache is on

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def total_steps(self) -> int:
        return len(self.noise_scheduler.timesteps) - self.t_start

    @property
    def timestep(self) -> torch.Tensor:
        return self.noise_scheduler.timesteps[self.t_start + self.step_index]

    @property
    def finished(self) -> bool:
        return self.step_index >= self.total_steps

    def tensors_nbytes(self) -> int:
        cached = 0 if self.cache is None else self.cache.tensors_nbytes()
        return self.latents.nbytes + sum(t.nbytes for t in self.cond.values() if isinstance(t, torch.Tensor)) + cached

    def move_to(self, device: torch.device) -> None:
        """Copy latents and conditioning to ``device`` (a preempted request's host offload, and back).

        A copy, never a cast, so the resumed request computes on the very same values. The per-request
        noise scheduler's few small tensors stay where they are.
        """
        self.latents = self.latents.to(device, copy=True)
        self.cond = {k: v.to(device, copy=True) if isinstance(v, torch.Tensor) else v for k, v in self.cond.items()}
        if self.cache is not None:
            self.cache.move_to(device)
