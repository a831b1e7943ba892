"""What every model family's tests share: the engine around a tiny family model, the bare diffusers call it must
equal, and the acceptance checks each family passes (models/test_families.py runs them over the registry).

A family's test module declares its ``FAMILY`` row (tiny kind, the bare call's family keywords, guidance
scales; an edit family's pictures); the checks observe the real engine and replace nothing.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import diffusers
import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from PIL import Image
from engine_probes import assert_no_state, count_denoiser_calls, max_diff, phased, progress_of, runner_of

from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.errors import RequestAbortedError
from stage_runtime.request import DiffusionRequest, EditInput, SamplingParams
from stage_runtime.video_request import VideoInput

SIZE = 64
RESULT_TIMEOUT = 300          # an upper bound only (a hang fails): a loaded 2-core machine runs a tiny edit for a minute
_PIPES: dict[str, DiffusionPipeline] = {}


def prompt_call(pipe, prompt: str, n: int, guidance: float) -> dict:
    """The bare call's family keywords of a text-to-image pipeline with CFG or distilled guidance."""
    return {"prompt": [prompt] * n, "guidance_scale": guidance}


def guider_call(pipe, prompt: str, n: int, guidance: float) -> dict:
    """The bare call's family keywords of a pipeline guided by its ``guider`` component (HunyuanVideo-1.5): its
    ``__call__`` takes no guidance_scale, so the pipeline gets a copy of its folder's guider at this scale; and
    diffusers 0.42.1's HunyuanVideo-1.5 VAE decodes one video at a time only (its causal attention mask does not
    broadcast over a batch), so two videos need VAE slicing."""
    pipe.guider = pipe.guider.new(guidance_scale=guidance)
    pipe.vae.enable_slicing()
    return {"prompt": [prompt] * n}


@dataclass(frozen=True)
class Family:
    """A family's row in the checklist (declared as ``FAMILY`` by its test module)."""

    kind: str                                        # its tiny kind (conftest's ``tiny_model(kind)``)
    call: Callable[..., dict] = prompt_call          # (pipe, prompt, n, guidance) → the bare call's own keywords
    guidances: tuple[float, float] = (7.5, 7.5)      # step mode's two requests (different when the step key allows)
    sized: bool = True                               # its __call__ takes height and width
    size: int = SIZE                                 # the checks' height and width
    frames: int | None = None                        # a video family: the checks' frame count
    reference: bool = False                          # image-to-video: requests carry reference_image(size)
    pipeline_class: str | None = None                # the bare call's diffusers class over the folder's components
    per_video: bool = False                          # the bare call takes one picture per video: n calls of one
    label: str | None = None                         # its id in the checklist (default: its kind)
    pictures: tuple[int, ...] = ()                   # an edit family: the sides of the pictures each request edits
    pretrained: Callable[[str], dict] | None = None  # (folder) → more from_pretrained keywords of the bare pipeline
    video_input: bool = False                        # video-to-video: requests carry source_video(size, frames)
    one_generator: bool = False                      # the bare call takes one generator, not a list (Wan VACE)

    @property
    def name(self) -> str:
        return self.label or self.kind

    def request(self, rid: str, prompt: str, steps: int, seed: int, **kw) -> DiffusionRequest:
        """A request at the row's size (and frame count: a video request)."""
        fields = {"height": self.size, "width": self.size, **({} if self.frames is None else {"num_frames": self.frames})}
        edit = None
        if self.pictures:
            first, *more = edit_pictures(self.pictures)
            edit = EditInput(first, more_images=tuple(more))
        return DiffusionRequest(rid, prompt, SamplingParams(num_inference_steps=steps, seed=seed, **{**fields, **kw}),
                                video=self.frames is not None,
                                reference=reference_image(self.size) if self.reference else None, edit=edit,
                                video_input=source_video(self.size, self.frames) if self.video_input else None)


def reference_image(size: int) -> np.ndarray:
    """A deterministic uint8 (size, size, 3) picture for image-to-video: colour gradients and a bright square."""
    ramp = np.linspace(0, 255, size, dtype=np.float32)
    image = np.stack([np.add.outer(ramp, ramp) / 2, np.add.outer(ramp, 255 - ramp) / 2,
                      np.full((size, size), 96.0)], axis=-1)
    image[size // 4:size // 2, size // 4:size // 2] = 240
    return image.round().astype(np.uint8)


def source_video(size: int, frames: int) -> VideoInput:
    """A deterministic video-to-video input: a gradient picture drifting one pixel a frame, a mask video whose left
    half is white (generate) and right half black (keep), and one portrait reference picture (letterboxed)."""
    base = reference_image(size)
    clip = np.stack([np.roll(base, k, axis=1) for k in range(frames)])
    mask = np.zeros_like(clip)
    mask[:, :, : size // 2] = 255
    portrait = np.ascontiguousarray(reference_image(size * 3 // 2)[:, : size][:, ::-1])
    return VideoInput(clip, mask, (portrait,))


def video_keywords(video: VideoInput) -> dict:
    """The bare WanVACEPipeline call's conditioning keywords for ``video`` (PIL frames and pictures)."""
    def pictures(frames) -> list[Image.Image]:
        return [Image.fromarray(np.asarray(f), mode="RGB") for f in frames]
    given = {"video": video.frames, "mask": video.mask, "reference_images": video.references or None}
    return {name: pictures(value) for name, value in given.items() if value is not None}


def edit_pictures(sides: tuple[int, ...]) -> list[np.ndarray]:
    """An edit family's pictures: :func:`reference_image` at each side, every other one mirrored."""
    return [np.ascontiguousarray(reference_image(side)[:, ::-1] if i % 2 else reference_image(side))
            for i, side in enumerate(sides)]


def make_engine(path: str, mode: str = "request", adapter: str | None = None, warmup: bool = True,
                limits: dict | None = None, quantization: dict | None = None, **scheduler) -> DiffusionEngine:
    """An in-process engine over the folder (the checklist turns warmup off: it runs at the model's default
    size, 512 px for the tiny Qwen-Image)."""
    config = load_config({"model": {"path": path, "adapter": adapter}, "device": "cpu", "warmup": warmup,
                          "scheduler": {"execution_mode": mode, **scheduler}, "limits": limits or {},
                          "quantization": quantization or {}})
    return DiffusionEngine.make_engine(config)


def req(rid: str, prompt: str, steps: int, seed: int, **kw) -> DiffusionRequest:
    return DiffusionRequest(rid, prompt, SamplingParams(num_inference_steps=steps, seed=seed, **kw))


def bare_pipeline(path: str, pipeline_class: str | None = None, **pretrained) -> DiffusionPipeline:
    """The folder loaded by diffusers alone (cached per path: loading is the slow part; ``pretrained``: more
    ``from_pretrained`` keywords), or ``pipeline_class`` (a diffusers class name) built over its components."""
    key = path if pipeline_class is None else f"{path}#{pipeline_class}"
    if key not in _PIPES:
        pipe = DiffusionPipeline.from_pretrained(path, local_files_only=True, **pretrained) if pipeline_class is None \
            else _over_components(getattr(diffusers, pipeline_class), bare_pipeline(path, **pretrained))
        pipe.set_progress_bar_config(disable=True)
        _PIPES[key] = pipe
    return _PIPES[key]


def _over_components(cls, base: DiffusionPipeline) -> DiffusionPipeline:
    """``cls`` built over ``base``'s modules and the registered config it takes (e.g. TI2V-5B's ``expand_timesteps``
    and a ``boundary_ratio``, as ``cls.from_pretrained`` of the folder would read them)."""
    import inspect

    takes = inspect.signature(cls.__init__).parameters
    config = {k: v for k, v in base.config.items() if k in takes and k not in base.components and not k.startswith("_")}
    return cls(**{k: v for k, v in base.components.items() if k in takes}, **config)


def to_uint8(images) -> np.ndarray:
    return (np.asarray(images) * 255).round().clip(0, 255).astype(np.uint8)


def generators(seed: int, n: int) -> list[torch.Generator]:
    return [torch.Generator("cpu").manual_seed(seed + i) for i in range(n)]


def bare_call(family: Family, path: str, prompt: str, steps: int, seed: int, guidance: float,
              n: int = 1, **extra) -> np.ndarray:
    """The pipeline's own ``__call__`` for one request (one generator per image, seed + i) → uint8; a
    ``per_video`` family's n videos are n calls of one (seed + i each)."""
    if family.per_video and n > 1:
        return np.concatenate([bare_call(family, path, prompt, steps, seed + i, guidance, **extra) for i in range(n)])
    pipe = bare_pipeline(path, family.pipeline_class, **({} if family.pretrained is None else family.pretrained(path)))
    size = {"height": family.size, "width": family.size} if family.sized else {}
    if family.frames is not None:
        size["num_frames"] = family.frames
    if family.reference:
        size["image"] = Image.fromarray(reference_image(family.size), mode="RGB")
    if family.pictures:                  # an edit: one picture as it is, several as a list
        images = [Image.fromarray(picture, mode="RGB") for picture in edit_pictures(family.pictures)]
        size["image"] = images[0] if len(images) == 1 else images
    if family.video_input:
        size.update(video_keywords(source_video(family.size, family.frames)))
    gens = generators(seed, n)
    out = pipe(**family.call(pipe, prompt, n, guidance), **size, num_inference_steps=steps,
               generator=gens[0] if family.one_generator else gens, output_type="np", **extra)
    return to_uint8(out.images if family.frames is None else out.frames)


# -- the checklist's checks, on a fresh engine over the family's tiny model --------------------------------
def check_request_mode(family: Family, path: str) -> None:
    """Two requests fused into one call (n=1 and n=2) each equal their bare call within 1 uint8."""
    guidance = family.guidances[0]
    eng = make_engine(path, "request", max_num_seqs=2, request_batch_max_wait_ms=200, warmup=False)
    calls = count_denoiser_calls(eng)
    try:
        with eng._lock:              # admitted together: one wave, whatever the machine's speed
            a = eng.add_request(family.request("a", "a photo of a cat", 3, 1, guidance_scale=guidance))
            b = eng.add_request(family.request("b", "a red car", 3, 2, num_outputs=2, guidance_scale=guidance))
        out_a, out_b = a.result(timeout=RESULT_TIMEOUT), b.result(timeout=RESULT_TIMEOUT)
        assert calls[0] == 3, f"{calls[0]} denoiser forwards for two 3-step requests: they were not fused"
        assert max_diff(out_a.images, bare_call(family, path, "a photo of a cat", 3, 1, guidance)) <= 1
        assert max_diff(out_b.images, bare_call(family, path, "a red car", 3, 2, guidance, n=2)) <= 1
        assert out_a.images.std() > 5 and max_diff(out_a.images, out_b.images[:1]) > 20
        assert_no_state(eng)
    finally:
        eng.close()


def check_step_mode(family: Family, path: str) -> None:
    """Requests of different step counts (and guidance, where the step key allows) share ticks; each equals its
    bare call within 2 uint8."""
    eng = make_engine(path, "step", max_num_seqs=4, warmup=False)
    calls = count_denoiser_calls(eng)
    try:
        g1, g2 = family.guidances
        with eng._lock:              # admitted together, whatever the machine's speed: the first tick holds both
            long = eng.add_request(family.request("long", "a photo of a cat", 6, 3, guidance_scale=g1))
            short = eng.add_request(family.request("short", "a red car", 3, 4, num_outputs=2, guidance_scale=g2))
        long_out, short_out = long.result(timeout=RESULT_TIMEOUT), short.result(timeout=RESULT_TIMEOUT)
        assert calls[0] == 6, f"{calls[0]} denoiser forwards for 6 + 3 steps: the requests did not share ticks"
        assert max_diff(long_out.images, bare_call(family, path, "a photo of a cat", 6, 3, g1)) <= 2
        assert max_diff(short_out.images, bare_call(family, path, "a red car", 3, 4, g2, n=2)) <= 2
        assert_no_state(eng)
    finally:
        eng.close()


def check_abort_next_to_a_batch_mate(family: Family, path: str, rounds: int = 4) -> None:
    """Abort at a random step, next to a running batch-mate: the stream ends aborted, all state is released."""
    eng = make_engine(path, "step", max_num_seqs=2, warmup=False)
    rng = random.Random(14)
    mate = eng.add_request(family.request("mate", "a tree", 400, 9))
    try:
        for i in range(rounds):
            target = rng.randint(1, 5)
            # long enough that it is still running when the reader (which may lag the engine on a loaded machine)
            # has seen the target step: it is aborted there, so its length costs nothing
            stream = eng.add_request(family.request(f"r{i}", "a dog", 400, i, stream=True))
            while stream.get(timeout=RESULT_TIMEOUT).step_index < target:
                pass
            assert eng.abort(f"r{i}") == [f"r{i}"]
            with pytest.raises(RequestAbortedError):
                stream.result(timeout=RESULT_TIMEOUT)
        assert not mate.finished
        eng.abort("mate")
        with pytest.raises(RequestAbortedError):
            mate.result(timeout=RESULT_TIMEOUT)
        assert_no_state(eng)
        assert eng.counters["aborted_total"] == rounds + 1
    finally:
        eng.close()


def check_progress_with_previews(family: Family, path: str) -> None:
    """A streamed request reports its phases in order (encode, every denoising step, decode), previews where
    asked, then one final image."""
    eng = make_engine(path, "step", max_num_seqs=2, streaming_output=True, warmup=False)
    try:
        items = list(eng.add_request(family.request("s", "a cat", 4, 3, preview_every=2)))
        assert progress_of(items) == phased(4) and items[-1].finished and items[-1].step_index == 4
        assert [i.step_index for i in items[:-1] if i.images is not None] == [2]
        assert [i.phase for i in items[:-1] if i.images is not None] == ["denoise"]
        frames = () if family.frames is None else (family.frames,)
        assert items[-1].images.shape == (1, *frames, family.size, family.size, 3)
    finally:
        eng.close()


# -- the same contracts on an engine a module already holds (any mode) ----------------------------------------
def check_different_step_counts_share_ticks(engine, solo, prompts: tuple[str, str], **kw) -> None:
    """Step mode: a long and a short request batched together each equal their solo runs (<= 2 uint8), and
    they shared denoiser calls (fewer forwards than 7 + 3)."""
    calls = [0]
    handle = runner_of(engine).adapter.denoiser.register_forward_pre_hook(
        lambda _m, _a: calls.__setitem__(0, calls[0] + 1))
    try:
        long = engine.add_request(req("long", prompts[0], 7, 5, **kw))
        short = engine.add_request(req("short", prompts[1], 3, 6, **kw))
        short_images = short.result(timeout=RESULT_TIMEOUT).images
        long_images = long.result(timeout=RESULT_TIMEOUT).images
    finally:
        handle.remove()
    assert calls[0] < 10, f"{calls[0]} denoiser calls: the two requests never shared a tick"
    assert max_diff(short_images, solo(prompts[1], 3, 6)) <= 2
    assert max_diff(long_images, solo(prompts[0], 7, 5)) <= 2
    assert_no_state(engine)


def check_progress_in_order(engine, prompt: str, steps: int = 5, **kw) -> None:
    items = list(engine.add_request(req("progress", prompt, steps, 3, stream=True, **kw)))
    assert progress_of(items) == phased(steps)
    assert items[-1].finished and items[-1].step_index == steps and items[-1].ok


def check_abort_at_random_steps(engine, prompt: str, rounds: int = 4, steps: int = 8, seed: int = 7, **kw) -> None:
    """Abort each request at a random step: it ends aborted within a step and nothing is left anywhere."""
    rng = random.Random(seed)
    for i in range(rounds):
        target = rng.randint(1, steps - 2)
        stream = engine.add_request(req(f"abort{i}", prompt, steps, i, stream=True, **kw))
        while stream.get(timeout=RESULT_TIMEOUT).step_index < target:
            pass
        assert engine.abort(f"abort{i}") == [f"abort{i}"]
        with pytest.raises(RequestAbortedError):
            stream.result(timeout=RESULT_TIMEOUT)
        assert_no_state(engine)
    assert runner_of(engine).num_request_states() == 0
