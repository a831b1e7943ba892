"""Reading request bodies at the edge: JSON (1 MiB) and the multipart form of ``POST /v1/images/edits``.

The app's ``client_max_size`` is the upload limit (``--max-upload-bytes``); JSON bodies keep their own
1 MiB bound, but for the video routes, whose JSON may carry base64 videos (Wan VACE), bounded by the upload limit. Uploaded images and masks are decoded here, once, into an EditInput (plain arrays):
undecodable → 400 naming the part, too many bytes or pixels → 413, a repeated text field → 400. Several
images (``image[]`` repeated, as the OpenAI SDK sends a list) are kept in order; whether the model takes
that many is decided at admission (``EditInput.resolve``: a 400 naming ``image[k]``).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from multidict import MultiDictProxy

from stage_runtime.errors import InvalidRequestError, RequestTooLargeError
from stage_runtime.imageio import decode_image, decode_mask
from stage_runtime.request import EditInput
from stage_runtime.serve.schemas import ImageEditRequest, parse_body

MAX_JSON_BYTES = 1024 * 1024
IMAGE_FIELDS = ("image", "image[]")
MAX_EDIT_IMAGES = 16           # uploads decoded at most; how many the model takes is checked at admission


async def read_json(request: web.Request, max_bytes: int = MAX_JSON_BYTES) -> Any:
    if request.content_length is not None and request.content_length > max_bytes:
        raise RequestTooLargeError("body", f"{request.content_length} bytes is over the JSON limit of {max_bytes}")
    body = await request.read()
    if len(body) > max_bytes:
        raise RequestTooLargeError("body", f"{len(body)} bytes is over the JSON limit of {max_bytes}")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InvalidRequestError("body", "<not JSON>", "must be a JSON object") from None


async def read_form(request: web.Request, max_bytes: int) -> MultiDictProxy:
    if not request.content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        raise InvalidRequestError("body", request.content_type or "<none>",
                                  "must be multipart/form-data (the fields and the files)")
    try:
        return await request.post()
    except web.HTTPRequestEntityTooLarge:
        raise RequestTooLargeError("body", f"the upload is over {max_bytes} bytes (--max-upload-bytes)") from None
    except ValueError as exc:
        raise InvalidRequestError("body", "<multipart>", f"not a readable form ({exc})") from None


def file_bytes(value: Any, field: str) -> bytes:
    if not isinstance(value, web.FileField):
        raise InvalidRequestError(field, str(value)[:64], "must be an uploaded file (multipart file part)")
    return value.file.read()


async def read_edit_form(request: web.Request, max_bytes: int, max_pixels: int) -> tuple[ImageEditRequest, EditInput]:
    """The edit form → its validated fields and the decoded image (+ mask)."""
    form = await read_form(request, max_bytes)
    fields: dict[str, Any] = {}
    images, mask = [], None
    for name in form.keys():
        values = form.getall(name)
        if name in IMAGE_FIELDS:
            images += [(f"image[{len(images) + i}]" if len(values) > 1 or images else name, v)
                       for i, v in enumerate(values)]
        elif name == "mask":
            if len(values) > 1:
                raise InvalidRequestError("mask", f"<{len(values)} files>", "give at most one mask")
            mask = values[0]
        elif len(values) > 1:
            raise InvalidRequestError(name, values[0], "given more than once")
        else:
            fields[name] = values[0]
    body = parse_body(ImageEditRequest, fields)
    if not images:
        raise InvalidRequestError("image", None, "Field required (an uploaded image file)")
    if len(images) > MAX_EDIT_IMAGES:
        raise InvalidRequestError(images[MAX_EDIT_IMAGES][0], "<file>",
                                  f"an edit takes at most {MAX_EDIT_IMAGES} images")
    decoded = [decode_image(file_bytes(upload, field), field, max_pixels) for field, upload in images]
    image = decoded[0]
    mask_array = None if mask is None else decode_mask(file_bytes(mask, "mask"), "mask", max_pixels)
    if mask_array is not None and mask_array.shape != image.shape[:2]:
        raise InvalidRequestError("mask", f"{mask_array.shape[1]}x{mask_array.shape[0]}",
                                  f"must be the image's size {image.shape[1]}x{image.shape[0]}")
    return body, EditInput(image, mask_array, body.strength, more_images=tuple(decoded[1:]))
