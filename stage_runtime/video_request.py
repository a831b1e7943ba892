"""A video request's own fields, checked against the serving family once at admission (``DiffusionRequest.resolve``).

A video family says in its ``ModelInfo`` which frame counts it takes (``frame_rule``: Wan ``4k+1``, LTX
``8k+1``), its defaults, and whether it has Wan 2.2's second expert (``guidance_scale_2``). A frame count off
the rule is a 400 naming the nearest counts it takes (diffusers rounds it down with a warning); an image family
refuses every video field. A family whose pipeline sizes the video from its picture (``reference_buckets``) gives a
request without a size the picture's bucket. No torch: the engine and the HTTP edge import this module.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Annotated

import numpy as np
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


MAX_REFERENCE_IMAGES = 8       # reference images of one video-to-video request (each one more latent frame)


@dataclass(frozen=True, eq=False)
class VideoInput:
    """The conditioning of a video-to-video request (Wan VACE), decoded at the edge into plain arrays (they pickle to
    the ranks): the source/control video, the mask video (white = generate, black = keep: diffusers' rule) and
    reference images. Any part may be absent; a mask needs the video it masks."""

    frames: np.ndarray | None = None            # uint8 (F, H, W, 3) RGB: ``input_video``
    mask: np.ndarray | None = None              # uint8 (F, H, W, 3) RGB: ``mask_video``
    references: tuple[np.ndarray, ...] = ()     # uint8 (H, W, 3) RGB each: ``reference_image[k]``

    @property
    def key(self) -> int:
        """What changes the denoised sequence beyond the request's size and frames: the reference count (each one
        more latent frame; 0, as without any video input)."""
        return len(self.references)

    def to_bytes(self) -> bytes:
        """The arrays in one ``.npz`` (lossless: a video job's stored input, read back on any replica)."""
        out = io.BytesIO()
        np.savez_compressed(out, **{name: array for name, array in self.arrays()})
        return out.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> VideoInput:
        with np.load(io.BytesIO(data), allow_pickle=False) as stored:
            names = sorted((n for n in stored.files if n.startswith("reference_image[")), key=lambda n: int(n[16:-1]))
            return cls(stored["input_video"] if "input_video" in stored.files else None,
                       stored["mask_video"] if "mask_video" in stored.files else None,
                       tuple(stored[name] for name in names))

    def arrays(self) -> list[tuple[str, np.ndarray]]:
        """Every array with its name (digests: the result cache, step checkpoints)."""
        named = [("input_video", self.frames), ("mask_video", self.mask)]
        named += [(f"reference_image[{k}]", image) for k, image in enumerate(self.references)]
        return [(name, array) for name, array in named if array is not None]


def _fitted(height: int, width: int, video_h: int, video_w: int, multiple: int) -> tuple[int, int]:
    """The size WanVACEPipeline conditions on for a ``video_h`` x ``video_w`` video at ``height`` x ``width``: the
    video's own, scaled down to fit when larger, rounded down to the size multiple (``preprocess_conditions``)."""
    if video_h * video_w > height * width:
        scale = min(width / video_w, height / video_h)
        video_h, video_w = int(video_h * scale), int(video_w * scale)
    return video_h // multiple * multiple, video_w // multiple * multiple


def resolve_video_input(video: VideoInput | None, s: BaseModel, info: ModelInfo) -> BaseModel:
    """``s`` (a request's SamplingParams) with the source video's size and frame count where the request gives none,
    after the family's refusals, each naming the upload: no video-to-video family; a mask without its video or of
    another frame count; too many references; a frame count off the family's rule or unequal to ``num_frames``; a
    video the pipeline would condition at another size than the one generated (the transformer adds the control
    tokens to the video's, one for one)."""
    if video is None:
        return s
    if not info.video_input:
        name = next(name for name, _ in video.arrays())
        raise InvalidRequestError(name, "<upload>", f"{info.pipeline_class} takes no source video, mask video or "
                                  "reference images (a video-to-video family does: WanVACEPipeline)")
    if len(video.references) > info.max_reference_images:
        raise InvalidRequestError(f"reference_image[{info.max_reference_images}]", "<file>",
                                  f"{info.pipeline_class} takes at most {info.max_reference_images} reference images "
                                  f"(got {len(video.references)})")
    if video.frames is None:
        if video.mask is not None:
            raise InvalidRequestError("mask_video", "<upload>", "a mask video needs the input_video it masks")
        return s
    count, video_h, video_w = video.frames.shape[:3]
    if video.mask is not None and len(video.mask) != count:
        raise InvalidRequestError("mask_video", f"{len(video.mask)} frames", f"must have input_video's {count} frames")
    multiple, remainder = info.frame_rule
    if count % multiple != remainder % multiple:
        raise InvalidRequestError("input_video", f"{count} frames",
                                  f"{info.pipeline_class} takes {multiple}k+{remainder} frames: trim the video")
    if s.num_frames is not None and s.num_frames != count:
        raise InvalidRequestError("num_frames", s.num_frames, f"must be input_video's frame count ({count}) "
                                  "or left out")
    step = info.size_multiple
    height, width = s.height or video_h // step * step, s.width or video_w // step * step
    if _fitted(height, width, video_h, video_w, step) != (height, width):
        got_h, got_w = _fitted(height, width, video_h, video_w, step)
        raise InvalidRequestError("input_video", f"{video_w}x{video_h}", (
            f"{info.pipeline_class} would condition on it at {got_w}x{got_h} (its size, scaled down to fit and "
            f"rounded down to multiples of {step}), not the {width}x{height} generated: give a video of that "
            "aspect ratio or leave size out"))
    return s.model_copy(update={"height": height, "width": width, "num_frames": count})


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
