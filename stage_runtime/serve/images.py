"""``POST /v1/images/generations`` and ``POST /v1/images/edits``: OpenAI's images API, JSON or SSE.

JSON: ``{"id", "created", "data": [{"b64_json"}], "output_format", "size", "quality", "background"}``
(PNG, JPEG or WebP). ``stream: true``: server-sent events (``serve.events``: OpenAI's event names by
default). A client that disconnects has its request aborted (aiohttp cancels the handler; the service
aborts what its consumer abandoned).
"""

from __future__ import annotations

import asyncio
import base64
from contextlib import aclosing

import numpy as np
from aiohttp import web

from stage_runtime.engine.stream import raise_for_output
from stage_runtime.errors import InvalidRequestError, RequestAbortedError, RequestTooLargeError, StageUnavailableError
from stage_runtime.imageio import encode_image
from stage_runtime.outputs import DiffusionOutput
from stage_runtime.serve.wake import ensure_awake
from stage_runtime.request import DiffusionRequest
from stage_runtime.serve.bodies import read_edit_form, read_json
from stage_runtime.serve.events import EventWriter
from stage_runtime.serve.schemas import (ImageGenerationRequest, ImageOptions, cache_report, error_body, images_body,
                                        parse_body)
from stage_runtime.serve.service import StageService

SERVICE = web.AppKey("service", StageService)
INLINE_ENCODE_PIXELS = 256 * 256          # larger batches are encoded off the event loop


def encode_b64(images: np.ndarray, output_format: str = "png", compression: int | None = None) -> list[str]:
    return [base64.b64encode(encode_image(image, output_format, compression)).decode("ascii") for image in images]


async def encode_images(images: np.ndarray, output_format: str = "png", compression: int | None = None) -> list[str]:
    if images.shape[0] * images.shape[1] * images.shape[2] <= INLINE_ENCODE_PIXELS:
        return encode_b64(images, output_format, compression)
    return await asyncio.to_thread(encode_b64, images, output_format, compression)


def check_model(body: ImageOptions, service: StageService) -> None:
    served = service.served_name
    if body.model is not None and served is not None and body.model != served:
        raise InvalidRequestError("model", body.model, f"this stage serves {served!r}")


async def create_images(request: web.Request) -> web.StreamResponse:
    """``POST /v1/images/generations`` (JSON)."""
    service = request.app[SERVICE]
    try:
        body = parse_body(ImageGenerationRequest, await read_json(request))
        check_model(body, service)
        engine_request = body.to_request(service.config.server.max_image_pixels)
    except (InvalidRequestError, RequestTooLargeError) as exc:
        service.metrics.count(exc.outcome)
        raise
    return await run_request(request, service, body, engine_request, "image_generation")


async def create_edits(request: web.Request) -> web.StreamResponse:
    """``POST /v1/images/edits`` (multipart: image, optional mask, the fields)."""
    service = request.app[SERVICE]
    server = service.config.server
    try:
        body, edit = await read_edit_form(request, server.max_upload_bytes, server.max_image_pixels)
        check_model(body, service)
        engine_request = body.to_request(edit, server.max_image_pixels)
    except (InvalidRequestError, RequestTooLargeError) as exc:
        service.metrics.count(exc.outcome)
        raise
    return await run_request(request, service, body, engine_request, "image_edit")


async def run_request(request: web.Request, service: StageService, body: ImageOptions,
                      engine_request: DiffusionRequest, event_prefix: str) -> web.StreamResponse:
    await ensure_awake(service)
    stream = service.submit(engine_request)

    async def encode(images: np.ndarray) -> list[str]:
        return await encode_images(images, body.output_format, body.output_compression)

    if body.stream:
        return await _stream_events(request, service, stream, EventWriter, body, event_prefix, encode)
    final = await final_output(service, stream)
    if isinstance(final, web.Response):
        return final
    height, width = final.images.shape[1:3]
    return web.json_response(images_body(final.request_id, await encode(final.images),
                                         output_format=body.output_format, size=f"{width}x{height}",
                                         quality=body.quality or "auto", background=body.background or "opaque",
                                         **cache_report(final.metrics)))


async def final_output(service: StageService, stream) -> DiffusionOutput | web.Response:
    """The stream's final output when it succeeded; raises the error tree's class for a failure (409 aborted,
    503 engine dead, 500 failed), except that a request aborted by the drain (not by a client) answers a 503 as
    the stage's unavailability, so the caller retries on another replica."""
    final = None
    async with aclosing(service.outputs(stream)) as items:
        async for item in items:
            final = item
    if final.error_type == RequestAbortedError.error_type and service.draining:
        return web.json_response(error_body(final.error_type, final.error), status=StageUnavailableError.http_status)
    raise_for_output(final)
    return final


async def _stream_events(request, service, stream, writer_cls, body, prefix, encode) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    await response.prepare(request)
    writer = writer_cls(response, body, prefix, encode)
    async with aclosing(service.outputs(stream)) as items:
        async for item in items:
            await writer.write(item)
    await response.write_eof()
    return response
