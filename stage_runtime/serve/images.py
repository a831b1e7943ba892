"""``POST /v1/images/generations``: OpenAI-compatible image generation, JSON or server-sent events.

JSON: ``{"id", "created", "data": [{"b64_json"}]}`` (PNG). ``stream: true``: one SSE event per
denoising step (``progress``; ``partial_image`` when a preview was decoded), then exactly one final
event, ``completed`` (the same body as JSON, plus ``type``) or ``error``. A client that disconnects has
its request aborted (aiohttp cancels the handler; the service aborts what its consumer abandoned).
"""

from __future__ import annotations

import asyncio
import base64
import json
from contextlib import aclosing
from typing import Any

import numpy as np
from aiohttp import web

from stage_runtime.engine.stream import raise_for_output
from stage_runtime.errors import InvalidRequestError, RequestAbortedError
from stage_runtime.imageio import encode_png
from stage_runtime.serve.schemas import ImageGenerationRequest, error_body, images_body, parse_body
from stage_runtime.serve.service import StageService

SERVICE = web.AppKey("service", StageService)
INLINE_ENCODE_PIXELS = 256 * 256          # larger batches are PNG-encoded off the event loop


def encode_b64_pngs(images: np.ndarray) -> list[str]:
    return [base64.b64encode(encode_png(image)).decode("ascii") for image in images]


async def encode_images(images: np.ndarray) -> list[str]:
    if images.shape[0] * images.shape[1] * images.shape[2] <= INLINE_ENCODE_PIXELS:
        return encode_b64_pngs(images)
    return await asyncio.to_thread(encode_b64_pngs, images)


async def read_generation(request: web.Request, service: StageService) -> ImageGenerationRequest:
    try:
        data = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InvalidRequestError("body", "<not JSON>", "must be a JSON object") from None
    gen = parse_body(ImageGenerationRequest, data)
    served = service.served_name
    if gen.model is not None and served is not None and gen.model != served:
        raise InvalidRequestError("model", gen.model, f"this stage serves {served!r}")
    return gen


async def create_images(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    try:
        gen = await read_generation(request, service)
        engine_request = gen.to_request()
    except InvalidRequestError:
        service.metrics.count("invalid")
        raise
    stream = service.submit(engine_request)
    if gen.stream:
        return await _stream_events(request, service, stream)
    final = None
    async with aclosing(service.outputs(stream)) as items:
        async for item in items:
            final = item
    if final.error_type == RequestAbortedError.error_type and service.draining:
        # Aborted by the drain, not by a client: 503, so the caller retries on another replica.
        return web.json_response(error_body(final.error_type, final.error), status=503)
    raise_for_output(final)                                # 409 aborted, 503 engine dead, 500 failed
    return web.json_response(images_body(final.request_id, await encode_images(final.images)))


async def _stream_events(request: web.Request, service: StageService, stream) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    await response.prepare(request)
    async with aclosing(service.outputs(stream)) as items:
        async for item in items:
            rid = item.request_id
            if not item.finished:
                await _send(response, "progress", {"id": rid, "step": item.step_index, "num_steps": item.num_steps})
                if item.images is not None:
                    await _send(response, "partial_image", {"id": rid, "step": item.step_index,
                                                            "data": [{"b64_json": b} for b in
                                                                     await encode_images(item.images)]})
            elif item.error is None:
                await _send(response, "completed", images_body(rid, await encode_images(item.images)))
            else:
                await _send(response, "error", {"id": rid, **error_body(item.error_type or "request_failed",
                                                                        item.error)})
    await response.write_eof()
    return response


async def _send(response: web.StreamResponse, event: str, data: dict[str, Any]) -> None:
    payload = json.dumps({"type": event, **data}, separators=(",", ":"))
    await response.write(f"event: {event}\ndata: {payload}\n\n".encode())
