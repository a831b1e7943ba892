"""Server-sent events for ``stream: true``, in one of two documented formats (``stream_format``).

``openai`` (the default; what the OpenAI SDK parses), with ``<p>`` = ``image_generation`` or ``image_edit``:
    <p>.progress        {type, id, phase, step, num_steps}    as the request enters its encode phase, after each
                                                              denoising step but the last, and as it enters its
                                                              decode phase (an extra event: the SDK yields it as
                                                              an object of that type)
    <p>.partial_image   {type, id, b64_json, partial_image_index, size, output_format, quality, background,
                         created_at}                          one per image when a preview was decoded
    <p>.completed       {type, id, b64_json, size, output_format, quality, background, created_at, usage}
                                                              one per image, at the end
    error               {type: "error", id, error: {type, message}}   instead of the completed events

``diffstage`` (the original contract): ``progress``, ``partial_image`` {id, step, data: [{b64_json}]},
then ``completed`` (the JSON body plus ``type``) or ``error``.
"""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web

from stage_runtime.errors import RequestFailedError
from stage_runtime.outputs import DiffusionOutput
from stage_runtime.serve.schemas import ImageOptions, cache_report, error_body, images_body

_USAGE = {"input_tokens": 0, "input_tokens_details": {"image_tokens": 0, "text_tokens": 0}, "output_tokens": 0,
          "total_tokens": 0}


async def send(response: web.StreamResponse, event: str, data: dict[str, Any]) -> None:
    payload = json.dumps({"type": event, **data}, separators=(",", ":"))
    await response.write(f"event: {event}\ndata: {payload}\n\n".encode())


class EventWriter:
    """Writes one request's stream items as events of its ``stream_format``."""

    def __init__(self, response: web.StreamResponse, body: ImageOptions, prefix: str, encode):
        self.response, self.body, self.prefix, self.encode = response, body, prefix, encode
        self.partials = 0

    def _image_fields(self, item: DiffusionOutput) -> dict[str, Any]:
        height, width = item.images.shape[1:3]
        return {"size": f"{width}x{height}", "output_format": self.body.output_format,
                "quality": self.body.quality or "auto", "background": self.body.background or "opaque",
                "created_at": int(time.time())}

    async def write(self, item: DiffusionOutput) -> None:
        if self.body.stream_format == "diffstage":
            await self._write_diffstage(item)
            return
        rid, p = item.request_id, self.prefix
        if not item.finished:
            await send(self.response, f"{p}.progress", {"id": rid, "phase": item.phase, "step": item.step_index,
                                                        "num_steps": item.num_steps})
            if item.images is not None:
                fields = self._image_fields(item)
                for b64 in await self.encode(item.images):
                    await send(self.response, f"{p}.partial_image", {"id": rid, "b64_json": b64,
                                                                     "partial_image_index": self.partials, **fields})
                self.partials += 1
        elif item.error is None:
            fields = self._image_fields(item)
            for b64 in await self.encode(item.images):
                await send(self.response, f"{p}.completed", {"id": rid, "b64_json": b64, "usage": _USAGE, **fields,
                                                             **cache_report(item.metrics)})
        else:
            await send(self.response, "error", {"id": rid, **_failure(item)})

    async def _write_diffstage(self, item: DiffusionOutput) -> None:
        rid = item.request_id
        if not item.finished:
            await send(self.response, "progress", {"id": rid, "phase": item.phase, "step": item.step_index,
                                                   "num_steps": item.num_steps})
            if item.images is not None:
                await send(self.response, "partial_image", {"id": rid, "step": item.step_index,
                                                            "data": [{"b64_json": b} for b in
                                                                     await self.encode(item.images)]})
        elif item.error is None:
            await send(self.response, "completed", images_body(rid, await self.encode(item.images),
                                                                **cache_report(item.metrics)))
        else:
            await send(self.response, "error", {"id": rid, **_failure(item)})


def _failure(item: DiffusionOutput) -> dict:
    """A failed final item's ``error`` member (a failure without a type is a failed request)."""
    return error_body(item.error_type or RequestFailedError.error_type, item.error)
