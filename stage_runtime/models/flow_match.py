"""Per-request flow-matching schedules (FLUX, SD3, Qwen-Image): the timesteps a pipeline's ``__call__`` would set.

With ``use_dynamic_shifting`` the schedule depends on the image: ``mu`` is a linear function of the image
token count, from ``base_shift`` at ``base_image_seq_len`` tokens to ``max_shift`` at ``max_image_seq_len``
(FLUX.1: 0.5 at 256 tokens to 1.15 at 4096). Otherwise the scheduler's static ``shift`` applies. Each
request gets its own scheduler copy, so requests of different sizes or step counts never share state.
"""

from __future__ import annotations

import copy

import numpy as np
import torch


def resolution_shift(image_seq_len: int, config, max_shift_default: float) -> float:
    """``mu`` for ``image_seq_len`` image tokens, from the scheduler config (family defaults where unset)."""
    base_len = config.get("base_image_seq_len", 256)
    max_len = config.get("max_image_seq_len", 4096)
    base_shift = config.get("base_shift", 0.5)
    max_shift = config.get("max_shift", max_shift_default)
    slope = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * slope + (base_shift - slope * base_len)


def flux_sigmas(num_steps: int, scheduler_config) -> np.ndarray | None:
    """FLUX.1's sigmas: 1 → 1/steps evenly (None when the scheduler makes its own flow sigmas)."""
    if scheduler_config.get("use_flow_sigmas", False):
        return None
    return np.linspace(1.0, 1 / num_steps, num_steps)


def request_flow_scheduler(scheduler, num_steps: int, device: torch.device, image_seq_len: int,
                           max_shift_default: float, sigmas: np.ndarray | None = None):
    """A private copy of ``scheduler`` with this request's timesteps, positioned at step 0."""
    own = copy.deepcopy(scheduler)
    kwargs = {}
    if own.config.get("use_dynamic_shifting", False):
        kwargs["mu"] = resolution_shift(image_seq_len, own.config, max_shift_default)
    if sigmas is None:
        own.set_timesteps(num_steps, device=device, **kwargs)
    else:
        own.set_timesteps(sigmas=sigmas, device=device, **kwargs)
    own.set_begin_index(0)
    return own
