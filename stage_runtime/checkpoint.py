"""A step checkpoint's file, its manifest and what a request resuming from it must match. No torch: the engine
checks a resume at admission and the job runner picks checkpoints with this module alone; the rank that writes and
reads the tensors is ``stage_runtime.models.step_checkpoint``.

A checkpoint is one safetensors file (plain data: a JSON header, then raw tensor bytes; nothing is unpickled)
written by the rank holding the request's step state, under a temp name, then renamed over its path. Its
header's ``__metadata__["diffstage"]`` is the manifest, JSON:

    format      FORMAT
    model       the fingerprint of the model that wrote it (ModelInfo.fingerprint)
    request     the request's identity (request_identity): prompt, sizes, steps, guidance, seed, adapters, inputs
    step        denoising steps done; total_steps the request's count (step == total_steps: denoised, not decoded)
    state       the step state as a tree of plain values whose tensors are the file's tensors, by name
    request_id, saved_at (wall-clock seconds)

A request resumes from a checkpoint only when the model's fingerprint and every identity field are equal; the
first that differs is a 400 naming ``resume_from``.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

from stage_runtime.errors import InvalidRequestError
from stage_runtime.model_info import ModelInfo
from stage_runtime.request import DiffusionRequest

FORMAT = "diffstage-step-checkpoint/1"
MANIFEST_KEY = "diffstage"
MAX_HEADER_BYTES = 64 << 20        # the JSON header; the tensors follow it
FIELD = "resume_from"


def _digest(array) -> str | None:
    """16 hex digits of an input array's bytes and shape (a reference picture, an edit's image or mask)."""
    if array is None:
        return None
    return hashlib.sha256(repr(tuple(array.shape)).encode() + array.tobytes()).hexdigest()[:16]


def request_identity(request: DiffusionRequest) -> dict[str, Any]:
    """What a resumed request must share with the one checkpointed (both resolved against the model): what its
    step state was computed from. Progress, previews, priority, deadline and the block cache are not in it."""
    s, edit = request.sampling, request.edit
    return {
        "prompt": request.prompt, "negative_prompt": s.negative_prompt, "height": s.height, "width": s.width,
        "num_frames": s.num_frames, "num_outputs": s.num_outputs, "num_inference_steps": s.num_inference_steps,
        "guidance_scale": s.guidance_scale, "guidance_scale_2": s.guidance_scale_2, "true_cfg_scale": s.true_cfg_scale,
        "seed": s.seed,
        "loras": [list(entry) for entry in request.lora_key], "task": request.task,
        "strength": None if edit is None else edit.strength, "reference": _digest(request.reference),
        "image": None if edit is None else _digest(edit.image), "mask": None if edit is None else _digest(edit.mask),
        # several uploaded images (Edit-Plus): the others too (a one-image identity is as it always was)
        **({"more_images": [_digest(image) for image in edit.more_images]} if edit is not None and edit.more_images
           else {}),
        # video-to-video (Wan VACE): the source video, its mask and the reference images (none: as it always was)
        **({"video_input": {name: _digest(array) for name, array in request.video_input.arrays()}}
           if request.video_input is not None else {}),
    }


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path``, read from its header alone; InvalidRequestError naming
    ``resume_from`` when there is no such file or it is not a step checkpoint."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            raw = f.read(size) if 0 < size <= MAX_HEADER_BYTES else None
    except FileNotFoundError:
        raise InvalidRequestError(FIELD, path, "no such checkpoint file") from None
    except OSError as exc:
        raise InvalidRequestError(FIELD, path, f"cannot read the checkpoint: {exc.strerror or exc}") from None
    if raw is None:
        raise InvalidRequestError(FIELD, path, "is not a step checkpoint (no safetensors header)")
    try:
        header = json.loads(raw)
    except ValueError as exc:                 # not JSON (UnicodeDecodeError too)
        raise InvalidRequestError(FIELD, path, f"is not a step checkpoint (its header: {exc})") from None
    return parse_manifest(header.get("__metadata__") if isinstance(header, dict) else None, path)


def parse_manifest(metadata: dict[str, str] | None, path: str) -> dict[str, Any]:
    """The manifest out of a safetensors header's ``__metadata__`` (InvalidRequestError naming ``resume_from`` when
    it holds none of this format)."""
    try:
        manifest = json.loads(metadata[MANIFEST_KEY])
    except (KeyError, TypeError, ValueError):
        raise InvalidRequestError(FIELD, path, "is a safetensors file, not a diffstage step checkpoint") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise InvalidRequestError(FIELD, path, f"checkpoint format {found!r}; this stage reads {FORMAT!r}")
    return manifest


def check_resume(request: DiffusionRequest, info: ModelInfo) -> dict[str, Any]:
    """The manifest of ``request.resume_from`` when the request may resume from it (the request resolved, its
    adapters' digests recorded); otherwise InvalidRequestError naming ``resume_from`` and the first difference."""
    manifest = read_manifest(request.resume_from)
    check_manifest(manifest, request, info)
    return manifest


def check_manifest(manifest: dict[str, Any], request: DiffusionRequest, info: ModelInfo) -> None:
    """InvalidRequestError naming ``resume_from`` unless the checkpoint is of ``info``'s model and of this request."""
    path = request.resume_from
    if manifest.get("model") != info.fingerprint:
        raise InvalidRequestError(FIELD, path, (
            f"the checkpoint was written by another model ({manifest.get('pipeline_class')}, fingerprint "
            f"{manifest.get('model')}); this stage serves {info.pipeline_class}, fingerprint {info.fingerprint}"))
    saved, ours = manifest.get("request") or {}, request_identity(request)
    for name, value in ours.items():
        if saved.get(name) != value:
            raise InvalidRequestError(FIELD, path, f"the checkpoint was made for {name}={saved.get(name)!r}; "
                                                   f"this request has {name}={value!r}")
