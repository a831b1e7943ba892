"""``POST /v1/videos``'s body: OpenAI's multipart form as ``client.videos.create`` sends it, or JSON.

The SDK always sends ``multipart/form-data``: ``prompt``, ``model``, ``seconds``, ``size`` and every
``extra_body`` key arrive as text fields (strings), ``input_reference`` as a file part. The text fields are
parsed as their fields' types ("9" → 9 for ``num_frames``; "nine" is a 400 naming it); a JSON body is typed
already and checked strictly, as on ``/v1/videos/sync`` (its ``input_reference``, ``input_video``, ``mask_video`` and
``reference_image`` are base64). A field given
twice, a file where a text field belongs and an unknown field are 400s naming the field.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from aiohttp import web

from stage_runtime.errors import InvalidRequestError
from stage_runtime.imageio import decode_image
from stage_runtime.jobs.record import JobRecord, new_job_id
from stage_runtime.request import DiffusionRequest
from stage_runtime.serve.bodies import file_bytes, read_form, read_json
from stage_runtime.serve.schemas import parse_body
from stage_runtime.serve.videos import VideoOptions
from stage_runtime.video_request import MAX_REFERENCE_IMAGES, VideoInput
from stage_runtime.videoio import decode_upload

FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")


UPLOADS = {"input_reference", "input_video", "mask_video", "reference_image"}   # kept beside the record, not in it


class VideoJobRequest(VideoOptions):
    """``POST /v1/videos``: the video's fields (those of ``/v1/videos/sync`` but how that call answers)."""

    @classmethod
    def stored(cls, params: dict[str, Any]) -> VideoJobRequest:
        """The request again from a job record's ``params`` (JSON-typed: a float may have come back an int)."""
        return parse_body(cls, params, strict=False)

    def params(self, seed: int) -> dict[str, Any]:
        """What the record keeps to run the job again on any replica: the fields as given, the seed fixed."""
        return {**self.model_dump(exclude=UPLOADS, exclude_none=True), "seed": seed}


VIDEO_FIELDS = ("input_video", "mask_video")                 # video-to-video uploads (Wan VACE), one file each
REFERENCE_FIELDS = ("reference_image", "reference_image[]")   # its reference images, repeated


async def read_job_body(request: web.Request, max_bytes: int, max_pixels: int
                        ) -> tuple[VideoJobRequest, np.ndarray | None, VideoInput | None]:
    """The validated fields, the decoded reference image (None without one) and the video-to-video uploads (None
    without any), each video decoded here with its bounds (``videoio.decode_upload``: bytes, duration, frames)."""
    if not request.content_type.startswith(FORM_TYPES):
        body = parse_body(VideoJobRequest, await read_json(request, max_bytes))
        return body, body.reference(max_pixels), await asyncio.to_thread(body.video_input, max_pixels)
    form = await read_form(request, max_bytes)
    fields: dict[str, Any] = {}
    reference, videos, references = None, {}, []
    for name in form.keys():
        values = form.getall(name)
        if name in REFERENCE_FIELDS:
            references += [(f"reference_image[{len(references) + i}]", v) for i, v in enumerate(values)]
            continue
        if len(values) > 1:
            raise InvalidRequestError(name, str(values[0])[:64], "given more than once")
        value = values[0]
        if name == "input_reference" and isinstance(value, web.FileField):
            reference = decode_image(file_bytes(value, name), name, max_pixels)
        elif name in VIDEO_FIELDS:
            videos[name] = await asyncio.to_thread(decode_upload, file_bytes(value, name), name, max_pixels)
        elif isinstance(value, web.FileField):
            raise InvalidRequestError(name, value.filename, "must be a text field, not a file")
        else:
            fields[name] = value
    body = parse_body(VideoJobRequest, fields, strict=False)
    if len(references) > MAX_REFERENCE_IMAGES:
        raise InvalidRequestError(references[MAX_REFERENCE_IMAGES][0], "<file>",
                                  f"a video takes at most {MAX_REFERENCE_IMAGES} reference images")
    pictures = tuple(decode_image(file_bytes(upload, field), field, max_pixels) for field, upload in references)
    video = VideoInput(videos.get("input_video"), videos.get("mask_video"), pictures) \
        if videos or pictures else None
    return body, reference if reference is not None else body.reference(max_pixels), video


def new_record(body: VideoJobRequest, resolved: DiffusionRequest, model: str, now: float) -> JobRecord:
    """The queued job's record, from the create request and its resolution against the model (defaults filled)."""
    s = resolved.sampling
    return JobRecord(id=new_job_id(now), model=model, prompt=body.prompt, params=body.params(s.seed),
                     size=f"{s.width}x{s.height}", num_frames=s.num_frames, fps=s.fps, num_steps=resolved.num_steps,
                     reference=resolved.reference is not None, video_input=resolved.video_input is not None,
                     created_at=now)
