"""Part 1: every served family (each tiny kind the adapters declare) on the device, in each dtype, in request and
step mode through the model runner, against the bare diffusers call of a separately loaded pipeline on the same
device with the same seed: within 1 uint8 in request mode and 2 in step mode (docs/testing.md, "Equal to
diffusers").

``CALLS`` says how each kind's bare call is made (the rows of ``tests/stage_runtime/models/test_*.py`` say the
same for the CPU suite). A kind the adapters declare without a row here is reported as an error, so a new family
cannot be left out silently.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TOLERANCE = {"request": 1, "step": 2}
STEPS = 3


@dataclass(frozen=True)
class Call:
    guidance: float
    size: int = 64
    frames: int | None = None          # a video family: its frame count
    style: str = "cfg"                 # cfg | class (DiT's labels) | kontext | true_cfg (Qwen) | guider (HunyuanVideo-1.5)
                                       # | vace (Wan VACE: a source video, its mask and a reference picture)
    sized: bool = True                 # its __call__ takes height and width (DiT's size is fixed)
    reference: bool = False            # image-to-video: the request carries a picture
    pictures: tuple[int, ...] = ()     # an instruction-edit family: the sides of the pictures it edits
    prompt: str = "a photo of a cat"


CALLS: dict[str, Call] = {
    "dit": Call(4.0, style="class", sized=False, prompt="207"),
    "digits": Call(4.0, style="class", sized=False, prompt="7"),     # the trained DiT: its labels are the digits
    "sd": Call(7.5), "sd3": Call(7.0), "sdxl": Call(5.0), "flux": Call(3.5), "flux2": Call(4.0),
    "flux2-klein": Call(4.0), "zimage": Call(3.0),
    "flux-kontext": Call(3.5, style="kontext"),
    "qwen-image": Call(4.0, style="true_cfg"),
    "qwen-image-edit": Call(4.0, style="true_cfg", pictures=(64,)),
    "qwen-image-edit-plus": Call(4.0, style="true_cfg", pictures=(64, 48)),
    "hunyuan-video15": Call(6.0, size=16, frames=9, style="guider"),
    # __call__ takes no size: the picture's bucket (16x16 for a 16x16 picture), the request none either
    "hunyuan-video15-i2v": Call(6.0, size=16, frames=9, style="guider", sized=False, reference=True),
    "ltx2": Call(3.0, size=64, frames=9),
    "wan": Call(6.0, size=16, frames=9), "wan22": Call(6.0, size=16, frames=9),
    "wan-ti2v": Call(5.0, size=32, frames=9), "wan-i2v": Call(5.0, size=16, frames=9, reference=True),
    "wan22-i2v": Call(5.0, size=16, frames=9, reference=True),
    "wan-vace": Call(5.0, size=16, frames=9, style="vace"),
}


def uncovered() -> list[str]:
    """Served tiny kinds without a row in CALLS (torch-free: the adapters' declarations, read by model_catalog)."""
    from stage_runtime.model_catalog import tiny_kinds

    return [kind for kind in tiny_kinds() if kind not in CALLS]


def picture(side: int, mirrored: bool = False) -> np.ndarray:
    """A deterministic uint8 (side, side, 3) picture: colour gradients and a bright square."""
    ramp = np.linspace(0, 255, side, dtype=np.float32)
    image = np.stack([np.add.outer(ramp, ramp) / 2, np.add.outer(ramp, 255 - ramp) / 2,
                      np.full((side, side), 96.0)], axis=-1)
    image[side // 4:side // 2, side // 4:side // 2] = 240
    image = image.round().astype(np.uint8)
    return np.ascontiguousarray(image[:, ::-1]) if mirrored else image


def pictures(call: Call) -> list[np.ndarray]:
    return [picture(side, mirrored=i % 2 == 1) for i, side in enumerate(call.pictures)]


def vace_input(call: Call):
    """Wan VACE's conditioning: the picture drifting a pixel a frame, a mask white (generated) on its left half, and
    one portrait reference picture (as tests/stage_runtime/family_checks.source_video)."""
    from stage_runtime.video_request import VideoInput

    clip = np.stack([np.roll(picture(call.size), k, axis=1) for k in range(call.frames)])
    mask = np.zeros_like(clip)
    mask[:, :, : call.size // 2] = 255
    return VideoInput(clip, mask, (np.ascontiguousarray(picture(call.size * 3 // 2)[:, : call.size][:, ::-1]),))


def to_uint8(images) -> np.ndarray:
    return (np.asarray(images, dtype=np.float32) * 255).round().clip(0, 255).astype(np.uint8)


def max_diff(a: np.ndarray, b: np.ndarray) -> int:
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())


def request(call: Call, rid: str, seed: int, steps: int = STEPS, **sampling):
    """The engine's request for one picture (or one video) of the call's shape (``sampling`` adds or overrides
    fields: another size, a priority)."""
    from stage_runtime.request import DiffusionRequest, EditInput, SamplingParams

    shape = {"height": call.size, "width": call.size} if call.sized else {}
    if call.frames is not None:
        shape["num_frames"] = call.frames
    shape.update(sampling)
    edit = None
    if call.pictures:
        first, *more = pictures(call)
        edit = EditInput(first, more_images=tuple(more))
    return DiffusionRequest(rid, call.prompt, SamplingParams(num_inference_steps=steps, seed=seed,
                                                             guidance_scale=call.guidance, **shape),
                            video=call.frames is not None, edit=edit,
                            reference=picture(shape.get("height", call.size)) if call.reference else None,
                            video_input=vace_input(call) if call.style == "vace" else None)


def bare_call(pipe, call: Call, seed: int, steps: int = STEPS, **size) -> np.ndarray:
    """The pipeline's own ``__call__`` for the same picture (CPU generator, as the engine's) → uint8."""
    import torch
    from PIL import Image

    from stage_runtime.models.refusals import class_id

    shape = {"height": call.size, "width": call.size} if call.sized else {}
    if call.frames is not None:
        shape["num_frames"] = call.frames
    shape.update(size)
    kw: dict = {"prompt": [call.prompt], "guidance_scale": call.guidance}
    if call.style == "class":
        labels = getattr(pipe, "labels", None) or {}
        kw = {"class_labels": [class_id(call.prompt, labels, pipe.transformer.config.num_embeds_ada_norm)],
              "guidance_scale": call.guidance}
    elif call.style == "kontext":
        kw["max_area"] = shape["height"] * shape["width"]
    elif call.style == "true_cfg":
        kw = {"prompt": call.prompt, "negative_prompt": " ", "true_cfg_scale": call.guidance,
              "num_images_per_prompt": 1}
    elif call.style == "guider":                       # the scale is the guider component's
        pipe.guider = pipe.guider.new(guidance_scale=call.guidance)
        kw = {"prompt": [call.prompt]}
    generator = [torch.Generator("cpu").manual_seed(seed)]
    if call.style == "vace":                           # one prompt and one generator (lists raise), the uploads
        given = vace_input(call)
        kw = {"prompt": call.prompt, "guidance_scale": call.guidance,
              "video": [Image.fromarray(f) for f in given.frames], "mask": [Image.fromarray(f) for f in given.mask],
              "reference_images": [Image.fromarray(r) for r in given.references]}
        generator = generator[0]
    if call.reference:
        kw["image"] = Image.fromarray(picture(shape.get("height", call.size)), mode="RGB")
    if call.pictures:
        images = [Image.fromarray(p, mode="RGB") for p in pictures(call)]
        kw["image"] = images[0] if len(images) == 1 else images
    with torch.inference_mode():
        out = pipe(**kw, **shape, num_inference_steps=steps, generator=generator, output_type="np")
    return to_uint8(out.images if call.frames is None else out.frames)


def bare_pipeline(path: str, kind: str, target, dtype: str):
    """The folder loaded by diffusers alone, moved to the device (Qwen's edit pipelines: with their processor)."""
    from diffusers import DiffusionPipeline

    from stage_runtime.models.adapter import DTYPES

    extra = {}
    if CALLS[kind].pictures:
        from stage_runtime.models.families.qwen_vl_processor import load_processor

        extra["processor"] = load_processor(path)
    pipe = DiffusionPipeline.from_pretrained(path, dtype=DTYPES[dtype], local_files_only=True, **extra)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(target.torch_device)


def runner_images(runner, req, mode: str) -> np.ndarray:
    """One request through the model runner: one request-mode wave, or step-mode ticks to its end."""
    from stage_runtime.scheduler_output import NewRequestData, SchedulerOutput

    resolved = req.resolve(runner.model_info)
    out = SchedulerOutput(step_id=1, scheduled_new_reqs=[NewRequestData(req.request_id, resolved)], mode=mode)
    for tick in range(2, req.sampling.num_inference_steps + 3):
        result = runner.execute_model(out).get(req.request_id)
        if result.error:
            raise RuntimeError(f"{mode} mode: {result.error}")
        if mode == "request" or result.finished:
            return result.images
        out = SchedulerOutput(step_id=tick, scheduled_cached_req_ids=[req.request_id], mode=mode)
    raise RuntimeError(f"{req.request_id} did not finish in {req.sampling.num_inference_steps} steps")


def make_runner(path: str, target, dtype: str, **config):
    import torch

    from stage_runtime.config import load_config
    from stage_runtime.worker.model_runner import DiffusionModelRunner

    torch.manual_seed(0)
    runner = DiffusionModelRunner(load_config({"model": {"path": path, "dtype": dtype}, "device": target.device,
                                               "warmup": False, **config}), target.torch_device)
    runner.load_model()
    return runner


def check_kind(kind: str, path: str, target, dtype: str, emit) -> None:
    """Request and step mode of one kind in one dtype, each against the bare call."""
    call = CALLS[kind]
    runner = make_runner(path, target, dtype)
    bare = bare_pipeline(path, kind, target, dtype)
    try:
        expected = bare_call(bare, call, seed=11)
        modes = ["request"] + (["step"] if runner.model_info.supports_step_execution else [])
        diffs = {mode: max_diff(runner_images(runner, request(call, f"{kind}-{mode}", seed=11), mode), expected)
                 for mode in modes}
        ok = all(diffs[mode] <= TOLERANCE[mode] for mode in modes)
        figure = ", ".join(f"{mode} {diffs[mode]} (<= {TOLERANCE[mode]})" for mode in modes)
        notes = [] if "step" in modes else ["no step contract: request mode only"]
        if float(expected.std()) < 1.0:
            notes.append("flat output (std < 1): the comparison shows little")
        emit(f"{kind} {dtype} vs bare diffusers", "ok" if ok else "FAIL", f"max|diff| {figure}", "; ".join(notes),
             kind=kind, dtype=dtype, max_diff=diffs, tolerance=TOLERANCE, std=float(expected.std()))
    finally:
        runner.close()
        del bare
        target.free()


def run(target, clock, emit, root: str, kinds: list[str] | tuple[str, ...] = ()) -> None:
    """Every kind (or ``kinds``) in the first dtype, then every kind in the next: when the budget runs out, each
    family has been checked in one dtype at least. The instruction-edit kinds go last: their pipelines encode the
    picture at about 1024² whatever the request's size (seconds each on a CPU)."""
    from stage_runtime.model_catalog import tiny_kinds
    from stage_runtime.models.tiny import make_tiny_model

    served = tiny_kinds()
    unknown = [k for k in kinds if k not in served]
    if unknown:
        raise ValueError(f"families={unknown}: not served kinds (served: {', '.join(served)})")
    paths: dict[str, str] = {}
    order = sorted(kinds or served, key=lambda k: bool(k in CALLS and CALLS[k].pictures))   # the slow edits last
    for dtype in target.dtypes:
        for kind in order:
            check = f"{kind} {dtype}"
            if kind not in CALLS:
                emit(check, "error", "", "a served kind without a bare call in gpucheck/families.py CALLS", kind=kind)
                continue
            if clock.spent():
                emit(check, "budget", "", clock.reason(), kind=kind, dtype=dtype)
                continue
            try:
                paths[kind] = paths.get(kind) or str(make_tiny_model(f"{root}/{kind}", kind=kind))
                check_kind(kind, paths[kind], target, dtype, emit)
            except Exception as exc:  # noqa: BLE001 - a broken family is a row, the others still run
                emit(check, "error", "", f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
                     kind=kind, dtype=dtype)
