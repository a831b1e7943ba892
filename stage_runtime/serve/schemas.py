"""HTTP bodies validated at the edge (pydantic, ``extra="forbid"``, strict types) and response shapes.

Every validation problem becomes an :class:`InvalidRequestError` naming the field and its value; the
route answers 400 with it. Inside the stage, types are trusted.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from stage_runtime.errors import InvalidRequestError
from stage_runtime.request import (MAX_LORAS_PER_REQUEST, MAX_PROMPT_CHARS, MAX_SIDE, CachePolicyField,
                                   DiffusionRequest, EditInput, Guidance, LoraRef, NegativePrompt, NumImages,
                                   PartialImages, PreviewEvery, Priority, SamplingParams, Seed, Steps, TimeoutS,
                                   TrueCfgScale)

_EDGE = ConfigDict(extra="forbid", strict=True, frozen=True)
_SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")


def parse_body(model: type[BaseModel], data: Any, strict: bool | None = None) -> Any:
    """Validate an untrusted JSON body; the first problem becomes an InvalidRequestError naming the field.
    ``strict=False``: a form's text fields, converted to the field's type ("9" → 9; "nine" is still a 400)."""
    if not isinstance(data, dict):
        raise InvalidRequestError("body", type(data).__name__, "must be a JSON object")
    try:
        return model.model_validate(data, strict=strict)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        field = ".".join(str(p) for p in err["loc"]) or "body"
        value = None if err["type"] == "missing" else err.get("input")
        raise InvalidRequestError(field, value, err["msg"].removeprefix("Value error, ")) from None


class ImageOptions(BaseModel):
    """What generations and edits share: OpenAI's fields (meaning in docs/http-api.md) plus our knobs."""

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    model: str | None = None                      # OpenAI clients send it; checked against the served name
    n: NumImages = 1
    response_format: Literal["b64_json"] = "b64_json"
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: int | None = Field(None, ge=0, le=100)    # jpeg/webp quality
    quality: Literal["auto", "low", "medium", "high", "standard", "hd", "xhigh", "max"] | None = None  # ignored
    style: Literal["vivid", "natural"] | None = None   # DALL·E 3's; accepted and ignored
    background: Literal["auto", "opaque", "transparent"] | None = None    # transparent: refused (RGB models)
    moderation: Literal["auto", "low"] | None = None   # accepted; this stage runs no moderation
    user: str | None = Field(None, max_length=256)     # accepted and ignored
    safety_identifier: str | None = Field(None, max_length=256)   # accepted and ignored
    seed: Seed | None = None
    num_inference_steps: Steps | None = None
    guidance_scale: Guidance | None = None
    negative_prompt: NegativePrompt | None = None
    true_cfg_scale: TrueCfgScale | None = None    # FLUX.1: true CFG with negative_prompt (stage_runtime.true_cfg)
    request_id: str | None = Field(None, min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")
    stream: bool = False
    partial_images: PartialImages | None = None   # previews while streaming (step mode)
    stream_format: Literal["openai", "diffstage"] = "openai"  # the SSE event names (docs/http-api.md)
    preview_every: PreviewEvery | None = None     # stream a decoded preview every k steps
    priority: Priority = 0                        # higher first (--scheduling-policy priority)
    timeout_s: TimeoutS | None = None             # 504 deadline_exceeded after
    cache: CachePolicyField = None                # "off" | {"threshold": x}; None: the stage's cache.mode
    loras: list[LoraRef] = Field(default_factory=list, max_length=MAX_LORAS_PER_REQUEST)   # applied in order

    @field_validator("size", check_fields=False)
    @classmethod
    def _size(cls, v: str | None) -> str | None:
        if v is None or v == "auto":
            return v
        match = _SIZE.match(v)
        if not match:
            raise ValueError("must be WIDTHxHEIGHT, e.g. 64x64" + (" or auto" if cls.allows_auto_size else ""))
        for side in (int(match[1]), int(match[2])):
            if not 8 <= side <= MAX_SIDE or side % 8:
                raise ValueError(f"each side must be a multiple of 8 between 8 and {MAX_SIDE}")
        return v

    allows_auto_size: ClassVar[bool] = False

    def width_height(self) -> tuple[int | None, int | None]:
        size = getattr(self, "size", None)
        if size is None or size == "auto":
            return None, None
        width, height = size.split("x")
        return int(width), int(height)

    def check(self, max_pixels: int) -> None:
        """Cross-field rules (400 naming the field)."""
        if getattr(self, "size", None) == "auto" and not self.allows_auto_size:
            raise InvalidRequestError("size", "auto", "auto is for edits (the input image's size)")
        width, height = self.width_height()
        if width is not None and width * height > max_pixels:
            raise InvalidRequestError("size", self.size, f"{width * height} pixels is over this stage's limit of "
                                                         f"{max_pixels} (--max-image-pixels)")
        if self.output_compression is not None and self.output_format == "png":
            raise InvalidRequestError("output_compression", self.output_compression,
                                      "applies to output_format jpeg or webp, not png")
        if self.background == "transparent":
            raise InvalidRequestError("background", "transparent", "this model produces opaque RGB images")
        if self.preview_every is not None and not self.stream:
            raise InvalidRequestError("preview_every", self.preview_every, "previews need stream=true")
        names = [c.name for c in self.loras]
        if len(set(names)) != len(names):
            raise InvalidRequestError("loras", names, "names an adapter twice")
        if self.partial_images and not self.stream:
            raise InvalidRequestError("partial_images", self.partial_images, "partial images need stream=true")

    def sampling(self) -> SamplingParams:
        width, height = self.width_height()
        return SamplingParams(
            num_inference_steps=self.num_inference_steps, width=width, height=height,
            guidance_scale=self.guidance_scale, negative_prompt=self.negative_prompt,
            true_cfg_scale=self.true_cfg_scale, seed=self.seed,
            num_outputs=self.n, stream=self.stream, preview_every=self.preview_every,
            partial_images=self.partial_images or 0, priority=self.priority, timeout_s=self.timeout_s,
            cache=self.cache, loras=tuple(self.loras))

    def new_request_id(self) -> str:
        return self.request_id or f"img-{uuid.uuid4().hex}"


class ImageGenerationRequest(ImageOptions):
    """``POST /v1/images/generations`` (JSON): strict types, unknown fields refused."""

    model_config = _EDGE
    size: str | None = None                       # "WIDTHxHEIGHT"; None: the model's default

    def to_request(self, max_pixels: int = MAX_SIDE * MAX_SIDE) -> DiffusionRequest:
        self.check(max_pixels)
        return DiffusionRequest(self.new_request_id(), self.prompt, self.sampling())


class ImageEditRequest(ImageOptions):
    """``POST /v1/images/edits``: the multipart form's text fields (form values are strings: lax types).

    The files (``image``, ``image[]``, ``mask``) are decoded by ``serve.bodies`` into an EditInput.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    size: str | None = "auto"                     # "auto": the input image's size
    strength: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)   # None: 0.8 (img2img, inpaint)
    input_fidelity: Literal["high", "low"] | None = None     # OpenAI field; accepted and ignored
    allows_auto_size: ClassVar[bool] = True

    def to_request(self, edit: EditInput, max_pixels: int = MAX_SIDE * MAX_SIDE) -> DiffusionRequest:
        self.check(max_pixels)
        return DiffusionRequest(self.new_request_id(), self.prompt, self.sampling(), edit=edit)


class AbortBody(BaseModel):
    """``POST /v1/abort``: ``{"request_ids": [...]}`` or ``{"all": true}`` (exactly one of them)."""

    model_config = _EDGE
    request_ids: list[str] | None = Field(None, max_length=10_000)
    all: bool = False

    def check(self) -> AbortBody:
        if self.all and self.request_ids is not None:
            raise InvalidRequestError("all", True, "give request_ids or all=true, not both")
        if not self.all and self.request_ids is None:
            raise InvalidRequestError("request_ids", None, "give request_ids (a list) or all=true")
        return self


class WorkerStatus(BaseModel):
    rank: int
    pid: int | None
    alive: bool


class StartupView(BaseModel):
    """``startup`` in ``/v1/stats``: the phase while starting (None once ready) and its detail, the seconds so far,
    each finished phase's seconds, the model's size on disk (the operator reports them in status)."""

    model_config = ConfigDict(extra="forbid")
    phase: str | None
    detail: str
    elapsed_s: float
    phases: dict[str, float]
    model_bytes: int | None


class JobsView(BaseModel):
    """``jobs`` in ``/v1/stats`` (a stage with a job store): the video jobs this replica runs (``here``: they hand
    off to another replica when it drains) and the model's jobs in the shared store by status, at its last scan."""

    model_config = ConfigDict(extra="forbid")
    here: int
    queued: int
    in_progress: int
    completed: int
    failed: int


class CostView(BaseModel):
    """``cost`` in ``/v1/stats``: the replica's work in pixel-steps (pixels × frames × outputs per denoising step;
    ``engine.cost_meter``): left to do over the requests in flight, done so far, and done per second lately."""

    model_config = ConfigDict(extra="forbid")
    outstanding: int
    completed_total: int
    rate: float


class StageStats(BaseModel):
    """``GET /v1/stats`` — what the operator polls. Exactly these keys (``offload`` only with offload on, ``compile``
    only with compile on (serve/model_views.py), ``weights`` once the engine is loaded, ``jobs`` only with a job
    store)."""

    model_config = ConfigDict(extra="forbid")
    state: Literal["starting", "ready", "stalled", "draining", "dead"]
    waiting: int
    running: int
    capacity: int
    finished_total: int
    aborted_total: int
    failed_total: int
    world_size: int
    topology: str
    workers: list[WorkerStatus]
    startup: StartupView
    cost: CostView
    offload: list[dict[str, Any]] | None = None
    compile: dict[str, Any] | None = None
    weights: dict[str, Any] | None = None
    jobs: JobsView | None = None


def error_body(error_type: str, message: str, param: str | None = None) -> dict[str, Any]:
    """``{"error": {"type", "message"}}`` (+ OpenAI's ``param`` naming the bad field on a 400)."""
    error: dict[str, Any] = {"type": error_type, "message": message}
    if param is not None:
        error["param"] = param
    return {"error": error}


def cache_report(metrics: dict[str, float]) -> dict[str, Any]:
    """The response's ``cache`` member: steps computed/skipped (block cache), whether the result cache answered."""
    report: dict[str, Any] = {k: int(metrics[k]) for k in ("steps_computed", "steps_skipped") if k in metrics}
    if metrics.get("result_cache_hit"):
        report["result_cache_hit"] = True
    return {"cache": report} if report else {}


def images_body(request_id: str, b64_images: list[str], **extra: Any) -> dict[str, Any]:
    """OpenAI's ImagesResponse (+ our ``id``); ``extra``: output_format, size, quality, background."""
    return {"id": request_id, "created": int(time.time()), "data": [{"b64_json": b} for b in b64_images], **extra}
