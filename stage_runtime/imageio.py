"""Image bytes at the edges: output encoding (PNG, JPEG, WebP) and decoding of uploaded images and masks.

Outputs are uint8 HWC RGB arrays. Uploads are decoded once at the HTTP edge into the same plain arrays
(an image: uint8 (H, W, 3) RGB; a mask: uint8 (H, W), 255 = repaint); nothing past the edge sees bytes.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image

from stage_runtime.errors import InvalidRequestError, RequestTooLargeError

OUTPUT_FORMATS = ("png", "jpeg", "webp")
DEFAULT_COMPRESSION = 100        # jpeg/webp quality when output_compression is not given (OpenAI's default)


def encode_png(image: np.ndarray) -> bytes:
    return encode_image(image, "png")


def encode_image(image: np.ndarray, output_format: str = "png", compression: int | None = None) -> bytes:
    """Encode one uint8 (H, W, 3) image. ``compression`` (0–100) is the jpeg/webp quality."""
    buf = io.BytesIO()
    pil = Image.fromarray(np.ascontiguousarray(image), mode="RGB")
    if output_format == "png":
        pil.save(buf, format="PNG")
    elif output_format in ("jpeg", "webp"):
        quality = DEFAULT_COMPRESSION if compression is None else compression
        pil.save(buf, format=output_format.upper(), quality=quality)
    else:
        raise ValueError(f"unknown output_format {output_format!r}; expected one of {OUTPUT_FORMATS}")
    return buf.getvalue()


def _open(data: bytes, field: str, max_pixels: int) -> Image.Image:
    """Open (lazily: the header only) and bound the pixel count before anything is decompressed."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            pil = Image.open(io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise RequestTooLargeError(field, f"the image has too many pixels (limit {max_pixels})") from None
    except Exception as exc:       # PIL raises many types for garbage: every one is the client's fault
        raise InvalidRequestError(field, f"<{len(data)} bytes>", f"not a decodable image ({type(exc).__name__})") \
            from None
    width, height = pil.size
    if width * height > max_pixels:
        raise RequestTooLargeError(field, f"{width}x{height} = {width * height} pixels is over the limit of "
                                          f"{max_pixels} (--max-image-pixels)")
    try:
        pil.load()
    except Exception as exc:
        raise InvalidRequestError(field, f"<{len(data)} bytes>", f"not a decodable image ({type(exc).__name__})") \
            from None
    return pil


def decode_image(data: bytes, field: str, max_pixels: int) -> np.ndarray:
    """An uploaded image → uint8 (H, W, 3) RGB (alpha is dropped, palette and grey converted)."""
    return np.asarray(_open(data, field, max_pixels).convert("RGB"), dtype=np.uint8).copy()


def decode_mask(data: bytes, field: str, max_pixels: int) -> np.ndarray:
    """An uploaded mask → uint8 (H, W), 255 where the image is repainted.

    With an alpha channel (OpenAI's convention) the fully transparent pixels are repainted; without
    one (diffusers' convention) the white pixels are.
    """
    pil = _open(data, field, max_pixels)
    if pil.mode in ("RGBA", "LA", "PA") or (pil.mode == "P" and "transparency" in pil.info):
        alpha = np.asarray(pil.convert("RGBA"), dtype=np.uint8)[..., 3]
        return np.where(alpha == 0, 255, 0).astype(np.uint8)
    return np.asarray(pil.convert("L"), dtype=np.uint8).copy()
