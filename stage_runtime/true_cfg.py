"""A request's ``true_cfg_scale``, checked against the serving family once at admission (``DiffusionRequest.resolve``).

diffusers' FLUX.1 pipelines (``FluxPipeline``, its img2img and inpaint pipelines, ``FluxKontextPipeline``) run
*true* CFG — a second transformer pass per step on the negative prompt, combined as
``neg + true_cfg_scale × (cond − neg)`` — when ``true_cfg_scale > 1`` and a negative prompt is given; otherwise
they run one pass and ignore both. A family says it has that path with ``ModelInfo.true_cfg``. A scale over 1
is refused where there is no such path (naming what to send instead) or where it would be ignored (no negative
prompt); a negative prompt without the scale is the family's refusal (``models.refusals``). No torch: the engine
and the HTTP edge import this module.
"""

from __future__ import annotations

from pydantic import BaseModel

from stage_runtime.errors import InvalidRequestError
from stage_runtime.model_info import ModelInfo


def check_true_cfg(s: BaseModel, info: ModelInfo) -> None:
    """Refuse ``true_cfg_scale > 1`` (``s``: the request's SamplingParams) that the family would not run."""
    if s.true_cfg_scale is None or s.true_cfg_scale <= 1:
        return
    name, value = info.pipeline_class, s.true_cfg_scale
    if not info.true_cfg:
        instead = ("its guidance_scale is diffusers' true_cfg_scale: send guidance_scale instead"
                   if info.guidance == "true_cfg" else
                   "send guidance_scale (> 1: classifier-free guidance, with negative_prompt) instead"
                   if info.guidance == "cfg" else f"its guidance is {info.guidance!r}")
        raise InvalidRequestError("true_cfg_scale", value, f"{name} has no true CFG pass; {instead}")
    if s.negative_prompt is None:
        raise InvalidRequestError("true_cfg_scale", value, f"{name} runs true CFG only against a negative prompt "
                                  "(without one diffusers ignores true_cfg_scale): send negative_prompt with it "
                                  '("" for an empty one)')
