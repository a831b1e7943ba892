"""The cost bound on one request, checked at admission: output pixels × denoising steps × outputs (× frames for
video), against ``limits.max_request_cost`` or, by default, what one output at the model's native size costs
at the step limit. A request over it is a 400 naming the field to shrink, before anything is queued."""

from __future__ import annotations

from stage_runtime.config import LimitsConfig
from stage_runtime.config.limits import DEFAULT_COST_STEPS
from stage_runtime.errors import InvalidRequestError
from stage_runtime.model_info import ModelInfo
from stage_runtime.request import DiffusionRequest


def request_cost(request: DiffusionRequest) -> int:
    """What the denoiser computes for a resolved request, in pixel-steps."""
    s = request.sampling
    return s.height * s.width * (s.num_frames or 1) * max(request.num_steps, 1) * s.num_outputs


def max_request_cost(limits: LimitsConfig, info: ModelInfo) -> int:
    """The configured bound, or the model-derived default (native pixels × the step limit)."""
    if limits.max_request_cost is not None:
        return limits.max_request_cost
    return info.default_height * info.default_width * (info.default_frames or 1) * DEFAULT_COST_STEPS


def check_request_cost(request: DiffusionRequest, limit: int, info: ModelInfo) -> None:
    """Refuse a resolved request that costs more than ``limit``; the param is what to shrink first: the size
    when it is over the native one, else the outputs when there are several, else the steps."""
    cost = request_cost(request)
    if cost <= limit:
        return
    s = request.sampling
    if s.height * s.width > info.default_height * info.default_width:
        field, value = "size", f"{s.width}x{s.height}"
    elif (s.num_frames or 1) > (info.default_frames or 1):
        field, value = "num_frames", s.num_frames
    elif s.num_outputs > 1:
        field, value = "n", s.num_outputs
    else:
        field, value = "num_inference_steps", s.num_inference_steps
    frames = "" if s.num_frames is None else f" x {s.num_frames} frames"
    native_frames = "" if info.default_frames is None else f"x{info.default_frames}"
    raise InvalidRequestError(field, value, (
        f"{s.width}x{s.height} px{frames} x {request.num_steps} steps x {s.num_outputs} output(s) = {cost:,} "
        f"pixel-steps "
        f"is over this stage's limit of {limit:,} (limits.max_request_cost, --max-request-cost, "
        f"spec.engine.maxRequestCost; the default is {DEFAULT_COST_STEPS} steps of one output at the model's "
        f"native {info.default_width}x{info.default_height}{native_frames})"))
