"""An edit's uploads as the PIL images diffusers' edit pipelines take, at the request's size."""

from __future__ import annotations

from PIL import Image

from stage_runtime.request import EditInput


def pil_image(edit: EditInput, height: int, width: int) -> Image.Image:
    """The upload as PIL, resized (Lanczos) to the request's size when it asked for another one."""
    image = Image.fromarray(edit.image, mode="RGB")
    return image if image.size == (width, height) else image.resize((width, height), Image.LANCZOS)


def pil_mask(edit: EditInput, height: int, width: int) -> Image.Image:
    """The inpainting mask as PIL (L), resized (nearest) to the request's size."""
    mask = Image.fromarray(edit.mask, mode="L")
    return mask if mask.size == (width, height) else mask.resize((width, height), Image.NEAREST)
