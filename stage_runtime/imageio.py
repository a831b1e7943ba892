"""PNG encoding of output images (uint8 HWC arrays) at the edges: CLI files and HTTP b64_json."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def encode_png(image: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(image), mode="RGB").save(buf, format="PNG")
    return buf.getvalue()
