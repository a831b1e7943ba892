"""Requests: sampling parameters (validated at the edge), the request record and its state machine.

    add_request → WAITING ──schedule──► RUNNING ──ok───────────► FINISHED_COMPLETED
                     │                   ▲  │  ├──error / missing───► FINISHED_ERROR
                     │          resume   │  │  ├──deadline──────────► FINISHED_ERROR (deadline_exceeded)
                     │                   │  ▼  └──abort─────────────► FINISHED_ABORTED
                     │                 PREEMPTED (step mode) ──abort / deadline──► FINISHED_*
                     └──abort / deadline───────────────────────────► FINISHED_ABORTED | FINISHED_ERROR

No torch here: the scheduler and the HTTP edge import this module.
"""

from __future__ import annotations

import enum
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Annotated, Literal, NamedTuple

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from stage_runtime.config import LORA_NAME_PATTERN, MAX_CACHE_THRESHOLD
from stage_runtime.errors import InvalidRequestError
from stage_runtime.model_info import ModelInfo
from stage_runtime.true_cfg import check_true_cfg
from stage_runtime.video_request import Fps, Frames, VideoInput, reference_size, resolve_video, resolve_video_input

MAX_PROMPT_CHARS = 2000
DEFAULT_STRENGTH = 0.8         # an img2img / inpaint edit's strength when the request gives none
MAX_LORAS_PER_REQUEST = 8
MAX_SIDE = 4096                # pixels, either side
MAX_IMAGES = 16                # outputs of one request

# The sampling bounds, defined once: SamplingParams here and the HTTP bodies (serve/schemas.py) use these types.
Steps = Annotated[int, Field(ge=1, le=1000)]
Side = Annotated[int, Field(ge=8, le=MAX_SIDE)]
Guidance = Annotated[float, Field(ge=0.0, le=100.0, allow_inf_nan=False)]
# diffusers' true_cfg_scale (FLUX.1, Kontext): > 1 with a negative prompt runs a second, negative pass per step;
# 1 (its default) runs none. Below 1 would be a no-op diffusers accepts silently: refused at the edge.
TrueCfgScale = Annotated[float, Field(ge=1.0, le=100.0, allow_inf_nan=False)]
NegativePrompt = Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
Seed = Annotated[int, Field(ge=0, lt=2**63)]
NumImages = Annotated[int, Field(ge=1, le=MAX_IMAGES)]
PreviewEvery = Annotated[int, Field(ge=1, le=1000)]        # a decoded preview every k steps (step mode)
Priority = Annotated[int, Field(ge=-1000, le=1000)]        # higher runs first (--scheduling-policy priority)
TimeoutS = Annotated[float, Field(gt=0, le=86400, allow_inf_nan=False)]   # seconds from arrival
PartialImages = Annotated[int, Field(ge=0, le=3)]          # OpenAI's: this many previews, evenly spaced


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED_COMPLETED = 2
    FINISHED_ABORTED = 3
    FINISHED_ERROR = 4
    PREEMPTED = 5           # step mode: off the running set at a tick boundary, its step state kept

    @property
    def finished(self) -> bool:
        return RequestStatus.FINISHED_COMPLETED <= self <= RequestStatus.FINISHED_ERROR


class RequestCache(BaseModel):
    """A request's own block-cache policy: ``{"threshold": x}`` (the stage's other cache settings apply)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    threshold: float = Field(ge=0.0, le=MAX_CACHE_THRESHOLD, allow_inf_nan=False)


def _cache_policy(value: object) -> object:
    """``"off"``, ``{"threshold": x}`` or None, with one clear message for anything else."""
    if value is None or value == "off" or isinstance(value, RequestCache):
        return value
    if isinstance(value, dict) and set(value) == {"threshold"}:
        threshold = value["threshold"]
        if (isinstance(threshold, (int, float)) and not isinstance(threshold, bool)
                and 0 <= threshold <= MAX_CACHE_THRESHOLD):
            return RequestCache(threshold=float(threshold))
    raise ValueError(f'must be "off" or {{"threshold": x}} with 0 <= x <= {MAX_CACHE_THRESHOLD:g}')


CachePolicyField = Annotated[Literal["off"] | RequestCache | None, BeforeValidator(_cache_policy)]


class LoraRef(BaseModel):
    """One adapter a request applies: a loaded adapter's name and its scale (never a path). The same entry of
    ``loras`` over HTTP and ZMQ, with strict types at both (a scale is a number, never a string)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str = Field(pattern=LORA_NAME_PATTERN)
    scale: float = Field(1.0, ge=-16.0, le=16.0, allow_inf_nan=False)


class SamplingParams(BaseModel):
    """Per-request knobs. ``None`` means "the model's default", filled in once at admission."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_inference_steps: Steps | None = None
    height: Side | None = None
    width: Side | None = None
    guidance_scale: Guidance | None = None
    negative_prompt: NegativePrompt | None = None
    true_cfg_scale: TrueCfgScale | None = None    # a family with true CFG (ModelInfo.true_cfg); None: off
    seed: Seed | None = None
    num_outputs: NumImages = 1                    # images for this one prompt ("n")
    stream: bool = False                          # progress events (step k of n) on the output stream
    preview_every: PreviewEvery | None = None
    priority: Priority = 0
    timeout_s: TimeoutS | None = None             # deadline from arrival
    partial_images: PartialImages = 0             # step mode
    cache: CachePolicyField = None   # block cache: None = the stage's cache.mode
    # Video families only (ModelInfo.frame_rule): frames (None = the model's default), the encoded video's
    # frame rate, and Wan 2.2's guidance for its low-noise expert (None = guidance_scale, as diffusers)
    num_frames: Frames | None = None
    fps: Fps | None = None
    guidance_scale_2: Guidance | None = None
    # LoRA adapters by name, applied in this order (unfused, this request's rows only); not in any batch key
    loras: tuple[LoraRef, ...] = Field((), max_length=MAX_LORAS_PER_REQUEST)

    @field_validator("loras")
    @classmethod
    def _distinct_loras(cls, v: tuple[LoraRef, ...]) -> tuple[LoraRef, ...]:
        names = [ref.name for ref in v]
        if len(set(names)) != len(names):
            raise ValueError(f"names an adapter twice: {names}")
        return v

    @property
    def runs_true_cfg(self) -> bool:
        """diffusers' condition for true CFG: ``true_cfg_scale > 1`` and a negative prompt ("" is one)."""
        return self.true_cfg_scale is not None and self.true_cfg_scale > 1 and self.negative_prompt is not None

    @classmethod
    def parse(cls, data: dict) -> "SamplingParams":
        """Validate untrusted input; the first problem becomes an InvalidRequestError naming the field."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"]) or "sampling"
            raise InvalidRequestError(loc, err.get("input"), err["msg"]) from None


class RequestBatchKey(NamedTuple):
    """Requests fuse into one pipeline call only when every field here is equal (request mode).

    ``task`` is "generate", "img2img" or "inpaint" (each its own pipeline call); ``strength`` is the
    edit strength (None for a generation): one img2img call noises every image to the same timestep.
    """

    height: int
    width: int
    num_inference_steps: int
    guidance_scale: float
    task: str = "generate"
    strength: float | None = None


class StepBatchKey(NamedTuple):
    """Requests share a denoising tick only when every field here is equal (step mode).

    The step count is deliberately absent: requests with different step counts and progress share ticks.
    """

    height: int
    width: int
    guidance_scale: float


# A family narrows or widens what must match through ModelInfo.request_key / ModelInfo.step_key (names of
# SamplingParams fields); resolve() records them on the request. Without them the keys above apply.
CompatibilityKey = tuple  # RequestBatchKey | StepBatchKey | tuple of (field name, value) pairs


@dataclass(frozen=True, eq=False)
class EditInput:
    """The image-conditioning half of an edit request, decoded at the edge (plain arrays, pickles to ranks)."""

    image: np.ndarray                 # uint8 (H, W, 3) RGB, as uploaded
    mask: np.ndarray | None = None    # uint8 (H, W), 255 = repaint (inpaint); None = img2img
    # 0 < strength <= 1: how far the image is noised (OpenAI has none); None = DEFAULT_STRENGTH, or none at all
    # for an instruction edit (resolve() settles it)
    strength: float | None = None
    instruct: bool = False            # an instruction edit (the image conditions the sequence; set by resolve())
    step_rule: str = "int"            # how strength gives the step count (ModelInfo.edit_step_rule; set by resolve())
    more_images: tuple[np.ndarray, ...] = ()   # uint8 (H, W, 3) uploads after the first (image[1], …): Edit-Plus

    @property
    def images(self) -> tuple[np.ndarray, ...]:
        """Every uploaded image, in upload order (the first is ``image``)."""
        return (self.image, *self.more_images)

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        """(height, width) of each uploaded image: an instruction edit's conditioning tokens follow from them."""
        return tuple((int(im.shape[0]), int(im.shape[1])) for im in self.images)

    @property
    def task(self) -> str:
        """"img2img", "inpaint" (a mask) or "instruct" (a family whose edits are instruction edits)."""
        return "inpaint" if self.mask is not None else "instruct" if self.instruct else "img2img"

    def denoise_steps(self, num_inference_steps: int) -> int:
        """Steps actually run, as the family's diffusers ``get_timesteps``: ``min(int(steps × strength), steps)``
        (Stable Diffusion, SDXL) or ``steps − int(steps − steps × strength)`` (rule "flow": FLUX's float
        product); an instruction edit runs every step (it starts from noise)."""
        if self.instruct:
            return num_inference_steps
        strength = DEFAULT_STRENGTH if self.strength is None else self.strength
        if self.step_rule == "flow":
            return num_inference_steps - int(max(num_inference_steps - min(num_inference_steps * strength,
                                                                           num_inference_steps), 0))
        return min(int(num_inference_steps * strength), num_inference_steps)

    def resolve(self, info: ModelInfo) -> "EditInput":
        """The edit as ``info``'s family runs it: a mask-less edit on an instruction-edit family is an
        instruction edit (no strength); img2img and inpaint get the default strength when none was given. More
        images than the family takes are refused naming the first one too many (``image[k]``)."""
        if len(self.images) > info.max_edit_images:
            most = info.max_edit_images
            raise InvalidRequestError(f"image[{most}]", "<file>", f"{info.pipeline_class} edits "
                                      f"{'one image' if most == 1 else f'at most {most} images'} per request "
                                      f"(got {len(self.images)})")
        if self.mask is None and "img2img" not in info.edit_tasks and "instruct" in info.edit_tasks:
            if self.strength is not None:
                raise InvalidRequestError("strength", self.strength,
                                          f"{info.pipeline_class} runs instruction edits, which have no strength")
            return replace(self, instruct=True)
        if self.task not in info.edit_tasks:
            raise InvalidRequestError("mask" if self.mask is not None else "image", "<upload>",
                                      f"{info.pipeline_class} does not serve {self.task} edits "
                                      f"(it serves: {', '.join(info.edit_tasks) or 'none'})")
        return replace(self, strength=DEFAULT_STRENGTH if self.strength is None else self.strength,
                       step_rule=info.edit_step_rule)


@dataclass
class DiffusionRequest:
    """One prompt, one request id. The full request crosses to the workers once; after that only its id."""

    request_id: str
    prompt: str
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = field(default_factory=time.monotonic)
    # The serving family's compatibility fields (request mode, step mode), recorded by resolve(); None: the
    # default RequestBatchKey / StepBatchKey.
    key_fields: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    edit: EditInput | None = None                 # set for POST /v1/images/edits
    video: bool = False                           # asks for a video (a video route): the family must make videos
    reference: np.ndarray | None = None           # uint8 (H, W, 3): the image a video starts from (image-to-video)
    video_input: VideoInput | None = None         # video-to-video: source video, mask video, reference images
    seed_given: bool | None = None                # the client chose the seed (None: decided at creation)
    # The SHA-256 (16 hex) of each adapter in sampling.loras, recorded at admission (engine.lora_table)
    lora_digests: tuple[str, ...] = ()
    # A step checkpoint (stage_runtime.checkpoint) this request continues from instead of starting at step 0
    # (step mode; the job runner's, never an HTTP field): admission checks it was made for this model and request
    resume_from: str | None = None
    # Where the rank writes the request's step checkpoint once it is denoised, before it decodes (a job's decode
    # retry resumes from it and only decodes)
    save_denoised_to: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidRequestError("request_id", self.request_id, "must be a non-empty string")
        if not isinstance(self.prompt, str):
            raise InvalidRequestError("prompt", self.prompt, "must be a string")
        if len(self.prompt) > MAX_PROMPT_CHARS:
            raise InvalidRequestError("prompt", f"<{len(self.prompt)} chars>",
                                      f"longer than {MAX_PROMPT_CHARS} characters")
        for name in ("resume_from", "save_denoised_to"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(name, value, "must be the path of a step checkpoint")
        if self.seed_given is None:
            self.seed_given = self.sampling.seed is not None
        if self.sampling.seed is None:
            # Assigned at creation so every rank (and a retry) derives the same generator.
            self.sampling = self.sampling.model_copy(update={"seed": secrets.randbits(63)})

    def key_value(self, name: str) -> object:
        """One field of a family's compatibility key: a SamplingParams field, or a name that is not: "task" (the edit
        task: instruction edits lengthen the sequence), "edit_shapes" (each uploaded image's (height, width): an
        instruction edit's conditioning tokens follow from them; ()) or "video_input" (VideoInput.key; 0)."""
        if name == "task":
            return self.task
        if name == "edit_shapes":
            return () if self.edit is None else self.edit.shapes
        if name == "video_input":
            return 0 if self.video_input is None else self.video_input.key
        return getattr(self.sampling, name)

    @property
    def batch_key(self) -> CompatibilityKey:
        s, edit = self.sampling, self.edit
        task, strength = self.task, None if edit is None else edit.strength
        if self.key_fields is not None and self.key_fields[0] != RequestBatchKey._fields[:4]:
            return tuple((name, self.key_value(name)) for name in self.key_fields[0]) + (
                ("task", task), ("strength", strength))
        return RequestBatchKey(s.height, s.width, s.num_inference_steps, s.guidance_scale, task, strength)

    @property
    def task(self) -> str:
        """"generate", or the edit's task."""
        return "generate" if self.edit is None else self.edit.task

    @property
    def step_key(self) -> CompatibilityKey:
        s = self.sampling
        if self.key_fields is not None and self.key_fields[1] != StepBatchKey._fields:
            return tuple((name, self.key_value(name)) for name in self.key_fields[1])
        return StepBatchKey(s.height, s.width, s.guidance_scale)

    @property
    def lora_key(self) -> tuple[tuple[str, float, str | None], ...]:
        """The adapter set as a stable, hashable value: ((name, scale, digest), ...) in application order;
        () for a plain request. The digest (None before admission) tells two files of the same name apart,
        so caches keyed by it (prompt embeddings, results) never serve another adapter's output."""
        digests = self.lora_digests or (None,) * len(self.sampling.loras)
        return tuple((ref.name, ref.scale, digest) for ref, digest in zip(self.sampling.loras, digests, strict=True))

    @property
    def num_steps(self) -> int:
        """Denoising steps this request runs (an edit runs ``int(steps × strength)`` of its schedule)."""
        steps = self.sampling.num_inference_steps or 0
        return steps if self.edit is None else self.edit.denoise_steps(steps)

    def preview_at(self, step_index: int) -> bool:
        """Whether a preview is decoded after ``step_index`` steps (never after the last one)."""
        s, total = self.sampling, self.num_steps
        if step_index >= total:
            return False
        if s.preview_every and step_index % s.preview_every == 0:
            return True
        k = s.partial_images
        return bool(k) and step_index in {max(1, (total * (i + 1)) // (k + 1)) for i in range(k)}

    def resolve(self, info: ModelInfo) -> "DiffusionRequest":
        """Fill model defaults and check the request against what the model can serve (once, at admission)."""
        s, edit = resolve_video_input(self.video_input, self.sampling, info), None if self.edit is None else \
            self.edit.resolve(info)
        if self.video != info.video:
            raise InvalidRequestError("model", info.pipeline_class, (
                "makes videos: ask for one on a video route (POST /v1/videos/sync)" if info.video else
                "makes images: ask for them on an image route (POST /v1/images/generations)"))
        if (self.reference is None and info.reference == "required") or (
                self.reference is not None and info.reference is None):
            raise InvalidRequestError("input_reference", None if self.reference is None else "<image>", (
                f"{info.pipeline_class} makes a video from an image: give one" if self.reference is None else
                f"{info.pipeline_class} takes no reference image"))
        if edit is None and info.edits_only:
            raise InvalidRequestError("image", None, f"{info.pipeline_class} edits images and makes none from text "
                                      "alone: POST /v1/images/edits with the image(s) and the instruction")
        if edit is not None and edit.mask is not None and edit.mask.shape != edit.image.shape[:2]:
            raise InvalidRequestError("mask", f"{edit.mask.shape[1]}x{edit.mask.shape[0]}",
                                      f"must be the image's size {edit.image.shape[1]}x{edit.image.shape[0]}")
        auto = reference_size(self.reference, info) if edit is None else (
            edit.image.shape[0] // info.size_multiple * info.size_multiple,
            edit.image.shape[1] // info.size_multiple * info.size_multiple)
        height = s.height or auto[0] or info.default_height
        width = s.width or auto[1] or info.default_width
        for name, value, default in (("height", height, info.default_height), ("width", width, info.default_width)):
            if info.fixed_size and value != default:
                raise InvalidRequestError(
                    name, value, f"{info.pipeline_class} only serves {info.default_width}x{info.default_height}")
            if value % info.size_multiple:
                raise InvalidRequestError(name, value, f"must be a multiple of {info.size_multiple} "
                                                       f"({info.pipeline_class}'s latent grid)")
        steps = s.num_inference_steps or info.default_steps
        if info.max_steps is not None and steps > info.max_steps:
            raise InvalidRequestError("num_inference_steps", steps,
                                      f"{info.pipeline_class}'s noise scheduler places at most {info.max_steps} steps")
        if isinstance(s.cache, RequestCache) and info.block_cache_refusal:
            raise InvalidRequestError("cache", s.cache.model_dump(), info.block_cache_refusal)
        video = resolve_video(s, info)
        check_true_cfg(s, info)
        if edit is not None and edit.denoise_steps(steps) < 1:
            raise InvalidRequestError("strength", edit.strength,
                                      f"int(num_inference_steps={steps} × strength) is 0: no step would run")
        resolved = s.model_copy(update={
            "height": height,
            "width": width,
            "num_inference_steps": steps,
            "guidance_scale": info.default_guidance if s.guidance_scale is None else s.guidance_scale,
            **video,
        })
        return replace(self, sampling=resolved, key_fields=(info.request_key, info.step_key), edit=edit)


def adapter_identity(request: "DiffusionRequest") -> list[tuple[str, float, str | None]]:
    """The request's LoRA adapters as ``DiffusionRequest.lora_key`` gives them: ``[(name, scale, digest), ...]``
    in application order (the order changes the float sums), the digest naming the file loaded under the name.

    The hook every cache key takes adapters from (result cache, prompt-embedding cache); [] for a plain request.
    """
    return [tuple(entry) for entry in request.lora_key]
