"""HunyuanVideo15ImageToVideoPipeline: its facts, the picture required (naming ``input_reference``), a request
without a size sized by its picture as ``__call__`` sizes it, and a mean-flow transformer's ``timestep_r`` per row;
its ``FAMILY`` row runs the checklist (test_families.py: request and step mode equal to the bare call with the same
picture and seed, abort, progress).

The rest (the guider's window and scale per request, the ByT5 glyph rows) is text-to-video's code path, held by
test_hunyuan_video15.py.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_probes import assert_no_state, max_diff, runner_of
from family_checks import Family, bare_pipeline, generators, guider_call, make_engine, reference_image, to_uint8
from PIL import Image

from stage_runtime.config import ModelConfig
from stage_runtime.errors import InvalidRequestError
from stage_runtime.models.registry import resolve_adapter_class
from stage_runtime.request import DiffusionRequest, SamplingParams

torch.set_num_threads(1)
FAMILY = Family("hunyuan-video15-i2v", call=guider_call, guidances=(6.0, 3.0), size=16, frames=9, reference=True,
                sized=False)       # __call__ takes no height and width: a 16x16 picture makes a 16x16 video
# generate_crop_size_list(16, 4), as (height, width): the sizes __call__ picks from by the picture's aspect ratio
BUCKETS = ((32, 8), (28, 8), (24, 8), (20, 8), (20, 12), (16, 12), (16, 16), (12, 16), (12, 20), (8, 20), (8, 24),
           (8, 28), (8, 32))


@pytest.fixture(scope="module")
def tiny_path(tiny_hunyuan_video15_i2v_path) -> str:
    return tiny_hunyuan_video15_i2v_path


@pytest.fixture(scope="module")
def request_engine(tiny_path):
    engine = make_engine(tiny_path, "request", max_num_seqs=2, warmup=False)
    yield engine
    engine.close()


def video_request(rid: str, picture: np.ndarray | None, steps: int, seed: int, **fields) -> DiffusionRequest:
    params = SamplingParams(num_inference_steps=steps, seed=seed, num_frames=9, guidance_scale=6.0, **fields)
    return DiffusionRequest(rid, "a red car", params, video=True, reference=picture)


def bare_video(path: str, picture: np.ndarray, steps: int, seed: int, **extra) -> np.ndarray:
    """The pipeline's own call on ``picture`` (it sizes the video itself) → uint8 (1, F, H, W, 3)."""
    pipe = bare_pipeline(path)
    out = pipe(**guider_call(pipe, "a red car", 1, 6.0), image=Image.fromarray(picture, mode="RGB"), num_frames=9,
               num_inference_steps=steps, generator=generators(seed, 1), output_type="np", **extra)
    return to_uint8(out.frames)


@contextlib.contextmanager
def tapped(module: torch.nn.Module, take):
    """``take(kwargs)`` of every call of ``module``, in order (the tiny videos barely show a change in uint8: the
    checks below compare what the VAE decodes, or what the transformer is given)."""
    seen = []
    hook = module.register_forward_pre_hook(lambda _m, args, kw: seen.append(take(args, kw)), with_kwargs=True)
    try:
        yield seen
    finally:
        hook.remove()


def decoded(pipe):
    return tapped(pipe.vae.decoder, lambda args, _kw: args[0].clone())


def test_facts(tiny_path):
    info = resolve_adapter_class(ModelConfig(path=tiny_path)).load(tiny_path, torch.device("cpu")).info()
    assert (info.pipeline_class, info.adapter) == (
        "HunyuanVideo15ImageToVideoPipeline", "stage_runtime.models.families.hunyuan_video15_i2v:HunyuanVideo15ImageToVideoAdapter")
    assert info.reference == "required" and info.reference_buckets == BUCKETS
    assert info.video and info.frame_rule == (4, 1) and (info.default_frames, info.default_fps) == (121, 24)
    assert (info.default_height, info.default_width, info.size_multiple) == (12, 20, 4)   # T2V's 16:9 bucket
    assert info.step_key == ("height", "width", "num_frames") and info.parallel_kinds == ("cfg", "ring", "ulysses")


def test_a_request_without_a_picture_is_refused_naming_input_reference(request_engine):
    with pytest.raises(InvalidRequestError, match=r"^input_reference=None: HunyuanVideo15ImageToVideoPipeline makes a "
                                                  r"video from an image: give one"):
        request_engine.add_request(video_request("none", None, 2, 1, height=16, width=16))
    assert_no_state(request_engine)


def test_a_request_without_a_size_gets_the_pictures_bucket_and_the_pipelines_video(request_engine, tiny_path):
    """A 12x24 (height x width) picture and no size: the 12x20 bucket (nearest 1:2 among those at least as tall
    for their width), the picture cropped to it, as ``__call__`` does: the latents its call decodes (1e-4; another
    picture moves them far more) and its frames within 1 uint8."""
    picture = np.ascontiguousarray(np.concatenate([reference_image(12), reference_image(12)[:, ::-1]], axis=1))
    with decoded(bare_pipeline(tiny_path)) as want:
        frames = bare_video(tiny_path, picture, 2, 5)
        bare_video(tiny_path, np.ascontiguousarray(picture[::-1]), 2, 5)
    assert float((want[0] - want[1]).abs().max()) > 1e-2, "the picture conditions the video"
    with decoded(runner_of(request_engine).adapter.pipe) as got:
        out = request_engine.add_request(video_request("wide", picture, 2, 5)).result(timeout=120).images
    assert out.shape == (1, 9, 12, 20, 3) and max_diff(out, frames) <= 1
    assert float((got[0] - want[0]).abs().max()) <= 1e-4
    assert_no_state(request_engine)


def mean_flow_variant(tiny: str, out: Path) -> str:
    """The tiny folder with a ``use_meanflow`` transformer (the rest linked, not copied)."""
    from stage_runtime.models.tiny.common import seeded
    from stage_runtime.models.tiny.hunyuan_video15 import tiny_transformer

    out.mkdir()
    for item in Path(tiny).iterdir():
        if item.name != "transformer":
            (out / item.name).symlink_to(item)
    seeded(7, lambda: tiny_transformer(task_type="i2v", use_meanflow=True)).save_pretrained(out / "transformer")
    assert json.loads((out / "transformer" / "config.json").read_text())["use_meanflow"]
    return str(out)


def test_a_mean_flow_transformer_gets_each_requests_next_timestep_per_row(tiny_path, tmp_path):
    """Step mode, 3 and 2 steps sharing ticks: every forward carries ``timestep_r`` per row (each request's next
    timestep, 0 on its last step), and each video equals its bare call within 2 uint8."""
    path = mean_flow_variant(tiny_path, tmp_path / "meanflow")
    picture, bare = reference_image(16), bare_pipeline(path)
    with tapped(bare.transformer, lambda _a, kw: float(kw["timestep_r"][0])) as bare_r, decoded(bare) as want:
        frames = bare_video(path, picture, 3, 1), bare_video(path, picture, 2, 2)
    long_r, short_r = bare_r[0:6:2], bare_r[6::2]                  # two calls a step (cond, uncond): one each
    assert long_r[-1] == short_r[-1] == 0.0 and min(long_r[:-1] + short_r[:-1]) > 0
    engine = make_engine(path, "step", max_num_seqs=2, warmup=False)
    pipe = runner_of(engine).adapter.pipe
    try:
        with tapped(pipe.transformer, lambda _a, kw: sorted(kw["timestep_r"].tolist())) as seen, decoded(pipe) as got:
            with engine._lock:                                   # admitted together: they share ticks
                long = engine.add_request(video_request("long", picture, 3, 1))
                short = engine.add_request(video_request("short", picture, 2, 2))
            out = long.result(timeout=120).images, short.result(timeout=120).images
        assert_no_state(engine)
    finally:
        engine.close()
    # [cond; uncond] rows per request: the long request's then the short one's next timestep, per tick
    assert seen == [sorted([long_r[0]] * 2 + [short_r[0]] * 2), sorted([long_r[1]] * 2 + [0.0] * 2), [0.0] * 2]
    for i in range(2):
        assert max_diff(out[i], frames[i]) <= 2
        assert min(float((g - want[i]).abs().max()) for g in got) <= 1e-4
