"""What a model family refuses at admission: the ``check_request`` classmethod every adapter class has.

The engine calls it on each resolved request before queueing (``engine.admission``), so a request the family
cannot take is a 400 naming the field, never a failure on a rank. The engine process never loads the pipeline
and stays free of torch and diffusers, so the hook reads only the request and ModelInfo's plain facts, and it
is defined here, in a module that imports neither: adapter classes inherit it (``PipelineAdapter`` from
:class:`Refusals`, ``DiTAdapter`` from :class:`DiTRefusals`, the generic adapter from
:class:`GenericRefusals`), ``ModelInfo.refusals`` names the class that defines it, and the engine imports
that class alone. A family with refusals of its own adds a subclass here and puts it first in its adapter's
bases. ``DiffusionRequest.resolve`` already refuses what the common facts rule out (sizes, edits, steps,
cache policies); these are the rest.
"""

from __future__ import annotations

import zlib

from stage_runtime.errors import InvalidRequestError
from stage_runtime.model_info import ModelInfo
from stage_runtime.request import DiffusionRequest


class Refusals:
    """Every family's refusals by its ``guidance`` and ``true_cfg`` facts (SD, SDXL, SD3, FLUX.1, Kontext,
    Qwen-Image); ``true_cfg_scale`` itself is checked for every family by ``stage_runtime.true_cfg``."""

    @classmethod
    def check_request(cls, request: DiffusionRequest, info: ModelInfo) -> None:
        """Raise InvalidRequestError (the field, its value, why) for a resolved request this family cannot serve
        as asked: the pipeline would fail on it, or silently ignore a field the client set."""
        s, name = request.sampling, info.pipeline_class
        if s.negative_prompt and not s.runs_true_cfg:          # "" is no negative prompt
            # FLUX.1: a negative prompt only through true CFG (models.families.flux); without that path, none at all
            instead = (" except through true CFG: send true_cfg_scale > 1 with it (a second, negative pass per "
                       "step)") if info.true_cfg else ""
            if info.guidance == "distilled":
                raise InvalidRequestError("negative_prompt", s.negative_prompt, f"{name} is guidance-distilled (the "
                                          f"guidance scale is an embedding of one pass) and has no negative prompt"
                                          f"{instead}")
            if info.guidance == "none":
                raise InvalidRequestError("negative_prompt", s.negative_prompt, f"{name} has no guidance here "
                                          f"(guidance: none) and no negative prompt{instead}")
            if s.guidance_scale <= 1:
                raise InvalidRequestError("negative_prompt", s.negative_prompt, f"unused at guidance_scale="
                                          f"{s.guidance_scale:g}: {name} applies a negative prompt only through "
                                          "classifier-free guidance, guidance_scale > 1")
        if info.guidance == "none" and s.guidance_scale != info.default_guidance:
            raise InvalidRequestError("guidance_scale", s.guidance_scale, f"{name} has no guidance here (guidance: "
                                      "none; no guidance embedding, no unconditional pass) and would ignore it; leave "
                                      f"it unset (or {info.default_guidance:g})")


class Flux2Refusals(Refusals):
    """FLUX.2's reference images as ``Flux2ImageProcessor.check_image_input`` takes them: each at least
    ``REFERENCE_MIN_SIDE`` pixels a side and at most ``REFERENCE_MAX_RATIO``:1 (larger ones are resized, not refused)."""

    REFERENCE_MIN_SIDE, REFERENCE_MAX_RATIO = 64, 8

    @classmethod
    def check_request(cls, request: DiffusionRequest, info: ModelInfo) -> None:
        super().check_request(request, info)
        for i, picture in enumerate(() if request.edit is None else request.edit.images):
            height, width = picture.shape[:2]
            if min(height, width) < cls.REFERENCE_MIN_SIDE:
                raise InvalidRequestError(f"image[{i}]", f"{width}x{height}", f"{info.pipeline_class} takes reference "
                                          f"images of at least {cls.REFERENCE_MIN_SIDE} pixels a side")
            if max(width / height, height / width) > cls.REFERENCE_MAX_RATIO:
                raise InvalidRequestError(f"image[{i}]", f"{width}x{height}", f"{info.pipeline_class} takes reference "
                                          f"images of at most {cls.REFERENCE_MAX_RATIO}:1")


def class_id(prompt: str, labels: dict[str, int], num_classes: int) -> int:
    """The class a DiT prompt asks for: a decimal number as it is (it may be out of range: the check says so), a
    label of the model's table as its id, any other text as CRC32 of the text modulo ``num_classes``."""
    text = prompt.strip()
    if text.isascii() and text.isdigit():
        return int(text)
    if text in labels:
        return int(labels[text])
    return zlib.crc32(text.encode()) % num_classes


class DiTRefusals(Refusals):
    """DiT takes a class, not text (ModelInfo ``num_classes``, ``class_labels``)."""

    @classmethod
    def check_request(cls, request: DiffusionRequest, info: ModelInfo) -> None:
        """No negative prompt (the unconditional pass is the null class); a class id below the class count (the
        class embedding has no other row)."""
        s = request.sampling
        if s.negative_prompt:
            raise InvalidRequestError("negative_prompt", s.negative_prompt, f"{info.pipeline_class} is class-"
                                      "conditional and has no negative prompt (its unconditional pass is the null "
                                      "class)")
        label = class_id(request.prompt, dict(info.class_labels), info.num_classes)
        if not 0 <= label < info.num_classes:
            raise InvalidRequestError("prompt", request.prompt, f"class id must be < {info.num_classes} "
                                      f"({info.pipeline_class}'s classes are 0..{info.num_classes - 1})")
        super().check_request(request, info)


class GenericRefusals(Refusals):
    """The generic adapter passes a request field only where ``__call__`` takes it (ModelInfo ``call_params``)."""

    @classmethod
    def check_request(cls, request: DiffusionRequest, info: ModelInfo) -> None:
        """A field the call does not take would be dropped: refused, unless unset or the default the stage fills
        in. (The generic adapter knows nothing of the pipeline's guidance: ``info.guidance`` is no fact here.)"""
        if info.call_params is None:           # no inspection of the call (not the generic adapter's info)
            return
        s, params = request.sampling, set(info.call_params)
        for field, value, unset in (("negative_prompt", s.negative_prompt or None, None),
                                    ("guidance_scale", s.guidance_scale, info.default_guidance),
                                    ("num_inference_steps", s.num_inference_steps, info.default_steps)):
            if field not in params and value != unset:
                raise InvalidRequestError(field, value, f"{info.pipeline_class}.__call__ takes no {field} (the "
                                          "generic diffusers adapter serves it; it would be ignored)")
        if s.num_outputs > 1 and not info.supports_request_batch and "num_images_per_prompt" not in params:
            raise InvalidRequestError("num_outputs", s.num_outputs, f"{info.pipeline_class}.__call__ makes one "
                                      "image per call (no list of prompts, no num_images_per_prompt): use n=1")


class ZImageRefusals(Refusals):
    """Z-Image guides at any guidance_scale > 0 (diffusers' ZImagePipeline: ``pos + s·(pos − neg)``), so a negative
    prompt is unused only at guidance_scale 0 (Z-Image-Turbo's setting), not at <= 1 as for the other CFG families."""

    @classmethod
    def check_request(cls, request: DiffusionRequest, info: ModelInfo) -> None:
        s = request.sampling
        if s.negative_prompt and s.guidance_scale <= 0:
            raise InvalidRequestError("negative_prompt", s.negative_prompt, f"unused at guidance_scale=0: "
                                      f"{info.pipeline_class} applies a negative prompt only through classifier-free "
                                      "guidance, guidance_scale > 0")


class LTX2Refusals(Refusals):
    """LTX-2: a side of one latent pixel (its VAE reflect-pads a side it cannot pad: diffusers raises); a picture
    with a one-pixel side (its H.264 re-compression crops sides to even: diffusers raises); a negative prompt is
    used at any video guidance scale (the audio's CFG, on by default, reaches the video too)."""

    @classmethod
    def check_request(cls, request: DiffusionRequest, info: ModelInfo) -> None:
        s = request.sampling
        for field, value in (("height", s.height), ("width", s.width)):
            if value < 2 * info.size_multiple:
                raise InvalidRequestError(field, value, f"{info.pipeline_class} needs at least {2 * info.size_multiple} "
                                          "(two latent pixels: its VAE pads each side by reflection)")
        if request.reference is not None and min(request.reference.shape[:2]) < 2:
            height, width = request.reference.shape[:2]
            raise InvalidRequestError("input_reference", f"{width}x{height}", (
                f"{info.pipeline_class} needs a picture of at least 2x2 pixels (it re-compresses it with H.264, "
                "which takes even sides)"))


def refusals_path(adapter_class: type) -> str:
    """``module:Class`` of the class in ``adapter_class``'s bases that defines the ``check_request`` it has
    (ModelInfo.refusals: what the engine imports)."""
    owner = next(k for k in adapter_class.__mro__ if "check_request" in vars(k))
    return f"{owner.__module__}:{owner.__qualname__}"
