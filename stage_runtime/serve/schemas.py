"""HTTP bodies validated at the edge (pydantic, ``extra="forbid"``, strict types) and response shapes.

Every validation problem becomes an :class:`InvalidRequestError` naming the field and its value; the
route answers 400 with it. Inside the stage, types are trusted.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from stage_runtime.errors import InvalidRequestError
from stage_runtime.request import MAX_PROMPT_CHARS, DiffusionRequest, SamplingParams

_EDGE = ConfigDict(extra="forbid", strict=True, frozen=True)
_SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")
MAX_SIDE = 4096
MAX_IMAGES = 16


def parse_body(model: type[BaseModel], data: Any) -> Any:
    """Validate an untrusted JSON body; the first problem becomes an InvalidRequestError naming the field."""
    if not isinstance(data, dict):
        raise InvalidRequestError("body", type(data).__name__, "must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        field = ".".join(str(p) for p in err["loc"]) or "body"
        value = None if err["type"] == "missing" else err.get("input")
        raise InvalidRequestError(field, value, err["msg"].removeprefix("Value error, ")) from None


class ImageGenerationRequest(BaseModel):
    """``POST /v1/images/generations``: OpenAI's fields plus the diffusion knobs of docs/http-api.md."""

    model_config = _EDGE
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    model: str | None = None                      # OpenAI clients send it; checked against the served name
    n: int = Field(1, ge=1, le=MAX_IMAGES)
    size: str | None = None                       # "WIDTHxHEIGHT"; None: the model's default
    response_format: Literal["b64_json"] = "b64_json"
    seed: int | None = Field(None, ge=0, lt=2**63)
    num_inference_steps: int | None = Field(None, ge=1, le=1000)
    guidance_scale: float | None = Field(None, ge=0.0, le=100.0, allow_inf_nan=False)
    negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    request_id: str | None = Field(None, min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")
    stream: bool = False
    preview_every: int | None = Field(None, ge=1, le=1000)   # stream a decoded preview every k steps
    priority: int = Field(0, ge=-1000, le=1000)             # higher first (--scheduling-policy priority)
    timeout_s: float | None = Field(None, gt=0, le=86400, allow_inf_nan=False)   # 504 deadline_exceeded after
    user: str | None = None                       # OpenAI field; accepted and ignored

    @field_validator("size")
    @classmethod
    def _size(cls, v: str | None) -> str | None:
        if v is None:
            return v
        match = _SIZE.match(v)
        if not match:
            raise ValueError("must be WIDTHxHEIGHT, e.g. 64x64")
        for side in (int(match[1]), int(match[2])):
            if not 8 <= side <= MAX_SIDE or side % 8:
                raise ValueError(f"each side must be a multiple of 8 between 8 and {MAX_SIDE}")
        return v

    def width_height(self) -> tuple[int | None, int | None]:
        if self.size is None:
            return None, None
        width, height = self.size.split("x")
        return int(width), int(height)

    def to_request(self) -> DiffusionRequest:
        width, height = self.width_height()
        if self.preview_every is not None and not self.stream:
            raise InvalidRequestError("preview_every", self.preview_every, "previews need stream=true")
        sampling = SamplingParams(
            num_inference_steps=self.num_inference_steps, width=width, height=height,
            guidance_scale=self.guidance_scale, negative_prompt=self.negative_prompt, seed=self.seed,
            num_outputs=self.n, stream=self.stream, preview_every=self.preview_every, priority=self.priority,
            timeout_s=self.timeout_s)
        return DiffusionRequest(self.request_id or f"img-{uuid.uuid4().hex}", self.prompt, sampling)


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


class StageStats(BaseModel):
    """``GET /v1/stats`` — what the operator polls. Exactly these keys."""

    model_config = ConfigDict(extra="forbid")
    state: Literal["starting", "ready", "draining", "dead"]
    waiting: int
    running: int
    capacity: int
    finished_total: int
    aborted_total: int
    failed_total: int
    world_size: int
    topology: str
    workers: list[WorkerStatus]


def error_body(error_type: str, message: str, param: str | None = None) -> dict[str, Any]:
    """``{"error": {"type", "message"}}`` (+ OpenAI's ``param`` naming the bad field on a 400)."""
    error: dict[str, Any] = {"type": error_type, "message": message}
    if param is not None:
        error["param"] = param
    return {"error": error}


def images_body(request_id: str, b64_images: list[str]) -> dict[str, Any]:
    return {"id": request_id, "created": int(time.time()), "data": [{"b64_json": b} for b in b64_images]}
