"""A video request's own fields, checked against the serving family once at admission (``DiffusionRequest.resolve``).

A video family says in its ``ModelInfo`` which frame counts it takes (``frame_rule``: Wan ``4k+1``, LTX
``8k+1``), its defaults, and whether it has Wan 2.2's second expert (``guidance_scale_2``). A frame count off
the rule is a 400 naming the nearest counts it takes (diffusers rounds it down with a warning); an image family
refuses every video field. A family whose pipeline sizes the video from its picture (``reference_buckets``) gives a
request without a size the picture's bucket. No torch: the engine and the HTTP edge import this module.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from stage_runtime.errors import InvalidRequestError
from stage_runtime.model_info import ModelInfo

MAX_FRAMES = 1025              # frames of one video
Frames = Annotated[int, Field(ge=1, le=MAX_FRAMES)]        # a video's frame count (the family's rule: below)
Fps = Annotated[int, Field(ge=1, le=240)]                  # frames per second of the encoded video
VIDEO_FIELDS = ("num_frames", "fps", "guidance_scale_2")


def resolve_video(s: BaseModel, info: ModelInfo) -> dict:
    """The video fields of a resolved request (``s``: its SamplingParams): checked against the family's frame
    rule (never rounded, as diffusers would do silently), defaults filled; an image family refuses them all."""
    given = {name: getattr(s, name) for name in VIDEO_FIELDS if getattr(s, name) is not None}
    if info.frame_rule is None:
        if given:
            name, value = next(iter(given.items()))
            raise InvalidRequestError(name, value, f"{info.pipeline_class} makes images, not videos")
        return {}
    if s.guidance_scale_2 is not None and not info.takes_guidance_2:
        raise InvalidRequestError("guidance_scale_2", s.guidance_scale_2,
                                  f"{info.pipeline_class} has one denoiser: guidance_scale_2 applies to Wan 2.2's "
                                  "two-expert models only")
    frames = info.default_frames if s.num_frames is None else s.num_frames
    multiple, remainder = info.frame_rule
    if frames % multiple != remainder % multiple:
        below = frames - (frames - remainder) % multiple
        raise InvalidRequestError("num_frames", frames, (
            f"{info.pipeline_class} takes {multiple}k+{remainder} frames "
            f"({', '.join(str(f) for f in (below, below + multiple) if f >= 1)} are the nearest)"))
    if info.max_frames is not None and frames > info.max_frames:
        raise InvalidRequestError("num_frames", frames, f"{info.pipeline_class} takes at most {info.max_frames} frames")
    return {"num_frames": frames, "fps": s.fps or info.default_fps}


def reference_size(reference, info: ModelInfo) -> tuple[int | None, int | None]:
    """(height, width) a request without a size gets from its reference picture (an array (h, w, 3)): the bucket of
    ``info.reference_buckets`` whose aspect ratio (height / width, rounded to 5 places) is nearest the picture's on
    the picture's side of square (the first such on a tie), as HunyuanVideo-1.5 I2V's ``__call__`` sizes its video
    (``calculate_default_height_width``); (None, None) without a picture or buckets (the model's default applies)."""
    if reference is None or not info.reference_buckets:
        return None, None
    height, width = reference.shape[:2]
    aspect = height / width
    ratios = [(round(h / w, 5) - aspect, (h, w)) for h, w in info.reference_buckets]
    side = [(abs(d), bucket) for d, bucket in ratios if (d <= 0 if aspect >= 1 else d >= 0)]
    return min(side, key=lambda pair: pair[0])[1]
