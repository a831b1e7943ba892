"""What one request may cost and how long a step may make no progress (part of :mod:`stage_runtime.config`).

A request's cost is its output pixels × denoising steps × outputs (× frames for video): what the denoiser
has to compute, so a stage can refuse at admission what it could never finish. A step that makes no
progress (a wedged kernel, a size far past what the hardware runs) is caught by the engine's watchdog:
past ``stall_unready_s`` the replica reports unready (the Service stops sending it work), past
``stall_fail_s`` it fails closed (exit 3, ``StepStalled``) and is restarted.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The default cost bound: what one output at the model's native size may cost at the step limit (1000).
DEFAULT_COST_STEPS = 1000


class LimitsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    # pixels × steps × outputs (× frames); None: the model's native pixels (× frames) × DEFAULT_COST_STEPS.
    max_request_cost: int | None = Field(None, ge=1)
    # No progress (a step, a phase) for this long while a request runs: /ready 503 "stalled". None: off.
    stall_unready_s: float | None = Field(120.0, gt=0, le=86400, allow_inf_nan=False)
    # … and for this long: fail closed (exit 3, StepStalled) so the replica is restarted. None: off.
    stall_fail_s: float | None = Field(600.0, gt=0, le=86400, allow_inf_nan=False)
    # The VAE decode's memory bound: decode frames in spatial tiles of at most this many pixels a side (the
    # family's VAE tiling, overlapping and blended; a video VAE already decodes one latent frame at a time).
    # None: whole frames, bitwise what diffusers' untiled call gives.
    decode_tile_side: int | None = Field(None, ge=32, le=4096)

    @model_validator(mode="after")
    def _fail_after_unready(self) -> LimitsConfig:
        if self.stall_unready_s is not None and self.stall_fail_s is not None \
                and self.stall_fail_s <= self.stall_unready_s:
            raise ValueError(f"stall_fail_s={self.stall_fail_s:g} must be longer than "
                             f"stall_unready_s={self.stall_unready_s:g} (unready first, then fail closed)")
        return self
