"""Keyword factories for the runtime's plain data: requests and model info with readable defaults."""

from __future__ import annotations

from typing import Any

from stage_runtime.model_info import ModelInfo
from stage_runtime.request import DiffusionRequest, SamplingParams

_SD_INFO = dict(pipeline_class="StableDiffusionPipeline", adapter="stage_runtime.models.families.sd:StableDiffusionAdapter",
                default_height=64, default_width=64, default_steps=20, default_guidance=7.5, size_multiple=8,
                fixed_size=False, supports_request_batch=True, supports_step_execution=True,
                num_attention_heads=4, max_steps=None, parallel_kinds=("cfg", "ulysses"), guidance="cfg",
                max_sequence_length=77)


def model_info(**overrides: Any) -> ModelInfo:
    """A tiny SD's ModelInfo, with any field overridden by name (``model_info(fixed_size=True)``)."""
    unknown = set(overrides) - set(ModelInfo.__dataclass_fields__)
    if unknown:
        raise TypeError(f"ModelInfo has no field(s) {sorted(unknown)}")
    return ModelInfo(**{**_SD_INFO, **overrides})


def make_request(request_id: str = "r", prompt: str = "a cat", **sampling: Any) -> DiffusionRequest:
    """One request; sampling fields by name (``make_request("a", num_inference_steps=2, seed=1)``)."""
    return DiffusionRequest(request_id, prompt, SamplingParams(**sampling))


def make_requests(n: int, steps: int = 2, prefix: str = "r", prompt: str = "a cat", **sampling: Any
                  ) -> list[DiffusionRequest]:
    """``n`` requests ``<prefix>0..`` with ``steps`` denoising steps and seeds 0..n-1."""
    return [make_request(f"{prefix}{i}", prompt, num_inference_steps=steps, seed=sampling.pop("seed", i), **sampling)
            for i in range(n)]
