"""``POST /v1/videos/sync``: one video, generated while the call waits (the job API, ``/v1/videos``, is
``jobs.routes``; both take the fields of :class:`VideoOptions` and answer with the helpers here).

The body is JSON (docs/http-api.md): OpenAI's ``prompt``, ``model``, ``size``, ``seconds``, and the video knobs
every video server takes (``num_frames``, ``fps``, steps, guidance, ``guidance_scale_2``, negative prompt,
seed), the request's block-cache policy (``cache``) and LoRA adapters (``loras``) as for images, for a
family that takes one ``input_reference`` (the first frame's picture, base64), and for video-to-video (Wan VACE)
``input_video``, ``mask_video`` (base64 videos) and ``reference_image`` (base64 pictures), decoded off the event
loop with the bounds of a multipart upload (the body itself within the upload limit). ``seconds`` without ``num_frames``
is ``seconds × fps + 1`` frames (N seconds are N × fps intervals); a request that ran with the block cache gets
its counts in ``X-Cache-Steps-Computed`` / ``X-Cache-Steps-Skipped``.
The answer is the MP4 (``video/mp4``: H.264, yuv420p) or, with ``response_format: "frames"``, the exact frames
losslessly as a zip of ``frame_0000.png …`` (``application/zip``). The engine never rounds a frame count: one
the family cannot take is a 400 naming ``num_frames``.

``stream: true`` answers server-sent events instead, so a long call shows where it is (and a proxy sees bytes):
``video.progress`` {id, phase, step, num_steps} as the request enters each phase — ``encode``, ``denoise``
(after each step but the last), ``decode``, then ``mux`` while the server encodes the MP4 (or zips the frames)
— and one ``video.completed`` {id, content_type, b64_json, frames, fps, size} with the answer's bytes, or one
``error`` {id, error: {type, message}}.
"""

from __future__ import annotations

import asyncio
import base64
import io
import uuid
import zipfile
from contextlib import aclosing
from typing import Literal

import numpy as np
from aiohttp import web
from pydantic import BaseModel, Field

from stage_runtime.errors import InvalidRequestError, RequestFailedError, RequestTooLargeError
from stage_runtime.imageio import decode_image, encode_image
from stage_runtime.outputs import Audio
from stage_runtime.request import (MAX_LORAS_PER_REQUEST, MAX_PROMPT_CHARS, MAX_SIDE, CachePolicyField,
                                   DiffusionRequest, Guidance, LoraRef, NegativePrompt, Priority, SamplingParams, Seed,
                                   Steps, TimeoutS)
from stage_runtime.serve.bodies import read_json
from stage_runtime.serve.events import send
from stage_runtime.serve.images import SERVICE, check_model, final_output
from stage_runtime.serve.schemas import _EDGE, _SIZE, error_body, parse_body
from stage_runtime.serve.wake import ensure_awake
from stage_runtime.video_request import MAX_REFERENCE_IMAGES, Fps, Frames, VideoInput
from stage_runtime.videoio import decode_upload, encode_mp4


class VideoOptions(BaseModel):
    """What a video request says on either video route (``/v1/videos/sync``, ``/v1/videos``): strict types,
    unknown fields refused."""

    model_config = _EDGE
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    model: str | None = None
    size: str | None = None                          # "WIDTHxHEIGHT"; None: the model's default
    seconds: int | None = Field(None, ge=1, le=600)   # OpenAI's; frames = seconds × fps + 1 without num_frames
    num_frames: Frames | None = None
    fps: Fps | None = None
    num_inference_steps: Steps | None = None
    guidance_scale: Guidance | None = None
    guidance_scale_2: Guidance | None = None
    negative_prompt: NegativePrompt | None = None
    seed: Seed | None = None
    priority: Priority = 0
    # image-to-video: the first frame's picture, base64 (PNG, JPEG, WebP…; a data: URL is accepted too)
    input_reference: str | None = Field(None, min_length=1)
    # video-to-video (Wan VACE), base64 in a JSON body (multipart on POST /v1/videos: file parts, jobs.form)
    input_video: str | None = Field(None, min_length=1)
    mask_video: str | None = Field(None, min_length=1)
    reference_image: list[str] = Field(default_factory=list)
    cache: CachePolicyField = None                # "off" | {"threshold": x}; None: the stage's cache.mode
    loras: list[LoraRef] = Field(default_factory=list, max_length=MAX_LORAS_PER_REQUEST)   # applied in order

    def reference(self, max_pixels: int) -> np.ndarray | None:
        if self.input_reference is None:
            return None
        return decode_image(_base64(self.input_reference, "input_reference", "image"), "input_reference", max_pixels)

    def video_input(self, max_pixels: int) -> VideoInput | None:
        """The JSON body's video-to-video inputs, decoded and bounded as uploads are (blocking: PyAV decodes the
        videos; call it off the event loop); None without any."""
        if len(self.reference_image) > MAX_REFERENCE_IMAGES:
            raise InvalidRequestError(f"reference_image[{MAX_REFERENCE_IMAGES}]", "<image>",
                                      f"a video takes at most {MAX_REFERENCE_IMAGES} reference images")
        videos = {name: decode_upload(_base64(text, name, "video"), name, max_pixels)
                  for name, text in (("input_video", self.input_video), ("mask_video", self.mask_video))
                  if text is not None}
        pictures = tuple(decode_image(_base64(text, f"reference_image[{i}]", "image"), f"reference_image[{i}]",
                                      max_pixels) for i, text in enumerate(self.reference_image))
        if not videos and not pictures:
            return None
        return VideoInput(videos.get("input_video"), videos.get("mask_video"), pictures)

    def video_request(self, request_id: str, default_fps: int | None, reference: np.ndarray | None,
                      video_input: VideoInput | None = None, **sampling: object) -> DiffusionRequest:
        """The engine's request (``sampling``: the route's own knobs, e.g. ``stream``, ``timeout_s``)."""
        width = height = None
        if self.size is not None:
            match = _SIZE.match(self.size)
            if not match or not all(8 <= int(side) <= MAX_SIDE for side in match.groups()):
                raise InvalidRequestError("size", self.size, f"must be WIDTHxHEIGHT, each side 8 to {MAX_SIDE}")
            width, height = int(match[1]), int(match[2])
        names = [ref.name for ref in self.loras]
        if len(set(names)) != len(names):
            raise InvalidRequestError("loras", names, "names an adapter twice")
        frames = self.num_frames
        if frames is None and self.seconds is not None:
            frames = self.seconds * (self.fps or default_fps or 16) + 1
        params = SamplingParams.parse({
            "height": height, "width": width, "num_frames": frames, "fps": self.fps,
            "num_inference_steps": self.num_inference_steps, "guidance_scale": self.guidance_scale,
            "guidance_scale_2": self.guidance_scale_2, "negative_prompt": self.negative_prompt, "seed": self.seed,
            "priority": self.priority, "cache": self.cache, "loras": tuple(self.loras), **sampling})
        return DiffusionRequest(request_id, self.prompt, params, video=True, reference=reference,
                                video_input=video_input)


class VideoGenerationRequest(VideoOptions):
    """``POST /v1/videos/sync`` (JSON): the video's fields, and how this call answers."""

    timeout_s: TimeoutS | None = None
    request_id: str | None = Field(None, min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")
    response_format: Literal["mp4", "frames"] = "mp4"
    stream: bool = False                             # server-sent events: the phases, then the answer

    def to_request(self, default_fps: int | None, max_pixels: int = MAX_SIDE * MAX_SIDE) -> DiffusionRequest:
        """The engine's request, its uploads decoded (blocking: :meth:`VideoOptions.video_input`)."""
        return self.video_request(self.request_id or f"video-{uuid.uuid4().hex}", default_fps,
                                  self.reference(max_pixels), self.video_input(max_pixels), timeout_s=self.timeout_s,
                                  stream=self.stream)


def _base64(text: str, field: str, kind: str) -> bytes:
    """A JSON body's base64 file (a ``data:`` URL too) → its bytes; a 400 naming ``field`` when it is not base64."""
    payload = text.split(",", 1)[1] if text.startswith("data:") else text
    try:
        return base64.b64decode(payload, validate=True)
    except ValueError:                                  # binascii.Error, or a character outside ASCII
        raise InvalidRequestError(field, payload[:32], f"must be a base64 {kind} (or a data: URL)") from None


def frames_zip(frames: np.ndarray) -> bytes:
    """The exact frames (F, H, W, 3) uint8 as a zip of lossless PNGs, ``frame_0000.png …`` (stored, not deflated:
    PNG is compressed already)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for index, frame in enumerate(frames):
            archive.writestr(f"frame_{index:04d}.png", encode_image(frame, "png"))
    return out.getvalue()


async def create_video_sync(request: web.Request) -> web.Response:
    """``POST /v1/videos/sync`` (JSON) → the MP4, or the frames as a zip of PNGs."""
    service = request.app[SERVICE]
    try:
        body = parse_body(VideoGenerationRequest, await read_json(request, service.config.server.max_upload_bytes))
        check_model(body, service)
        default_fps = service.model_info.default_fps if service.model_info is not None else None
        engine_request = await asyncio.to_thread(body.to_request, default_fps, service.config.server.max_image_pixels)
    except (InvalidRequestError, RequestTooLargeError) as exc:
        service.metrics.count(exc.outcome)
        raise
    await ensure_awake(service)
    stream = service.submit(engine_request)
    fps = engine_request.sampling.fps or service.model_info.default_fps
    if body.stream:
        return await _stream_video(request, service, stream, body.response_format, fps)
    final = await final_output(service, stream)
    if isinstance(final, web.Response):
        return final
    frames = final.images[0]
    headers = {"X-Request-Id": final.request_id, "X-Video-Frames": str(len(frames)), "X-Video-Fps": str(fps)}
    if "steps_computed" in final.metrics:          # the block cache ran for it
        headers.update({"X-Cache-Steps-Computed": str(int(final.metrics["steps_computed"])),
                        "X-Cache-Steps-Skipped": str(int(final.metrics["steps_skipped"]))})
    content, content_type = await _answer(frames, fps, body.response_format, final.audio)
    return web.Response(body=content, content_type=content_type, headers=headers)


async def _answer(frames: np.ndarray, fps: int, response_format: str, audio: Audio | None) -> tuple[bytes, str]:
    """The video's bytes as asked: the MP4 (with its sound track, for a model that makes one), or the exact
    frames zipped (off the event loop)."""
    if response_format == "frames":
        return await asyncio.to_thread(frames_zip, frames), "application/zip"
    track = None if audio is None else audio.track(0)
    return await asyncio.to_thread(lambda: encode_mp4(frames, fps, audio=track)), "video/mp4"


async def _stream_video(request: web.Request, service, stream, response_format: str, fps: int) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    await response.prepare(request)
    async with aclosing(service.outputs(stream)) as items:
        async for item in items:
            rid = item.request_id
            if not item.finished:
                await send(response, "video.progress", {"id": rid, "phase": item.phase, "step": item.step_index,
                                                        "num_steps": item.num_steps})
            elif item.error is not None:
                await send(response, "error", {"id": rid, **error_body(
                    item.error_type or RequestFailedError.error_type, item.error)})
            else:
                frames = item.images[0]
                await send(response, "video.progress", {"id": rid, "phase": "mux", "step": item.step_index,
                                                        "num_steps": item.num_steps})
                content, content_type = await _answer(frames, fps, response_format, item.audio)
                height, width = frames.shape[1:3]
                await send(response, "video.completed", {
                    "id": rid, "content_type": content_type, "b64_json": base64.b64encode(content).decode("ascii"),
                    "frames": len(frames), "fps": fps, "size": f"{width}x{height}"})
    await response.write_eof()
    return response
