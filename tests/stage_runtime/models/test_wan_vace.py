"""WanVACEPipeline (Wan VACE video-to-video): its facts, the conditioning (source video, mask video, reference
images) prepared as ``__call__`` does and equal to the bare call (its ``FAMILY`` row in the checklist,
test_families.py: request mode within 1 uint8, step mode within 2, abort, progress), requests with and without
references kept apart by both keys, and the admission refusals, each naming the upload."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from engine_probes import assert_no_state, count_denoiser_calls, max_diff
from family_checks import Family, bare_call, make_engine, source_video, video_keywords

from stage_runtime.config import ModelConfig
from stage_runtime.errors import InvalidRequestError
from stage_runtime.models.registry import resolve_adapter_class
from stage_runtime.video_request import VideoInput

torch.set_num_threads(1)


def vace_call(pipe, prompt: str, n: int, guidance: float) -> dict:
    """WanVACEPipeline takes one prompt (a list raises): n videos are n calls (``per_video``)."""
    return {"prompt": prompt, "guidance_scale": guidance}


# 32 px: at 16 the tiny random model's videos of two prompts and seeds differ by 20 uint8 only (the checklist asks > 20)
FAMILY = Family("wan-vace", call=vace_call, guidances=(5.0, 2.0), size=32, frames=9, video_input=True,
                one_generator=True, per_video=True)
SMALL = replace(FAMILY, size=16)                   # this module's own checks: 16x16x9


@pytest.fixture(scope="module")
def info(tiny_wan_vace_path):
    return resolve_adapter_class(ModelConfig(path=tiny_wan_vace_path)).load(tiny_wan_vace_path,
                                                                            torch.device("cpu")).info()


def test_facts(info):
    assert (info.pipeline_class, info.adapter) == ("WanVACEPipeline", "stage_runtime.models.families.wan_vace:WanVACEAdapter")
    assert info.video and info.frame_rule == (4, 1) and info.video_input and info.max_reference_images == 8
    assert info.reference is None and info.parallel_kinds == ("cfg", "ring", "ulysses") and info.lora_components == ("transformer",)
    assert info.step_key == ("height", "width", "num_frames", "video_input")
    assert info.request_key[-1] == "video_input" and info.block_cache_refusal is not None


def test_the_video_gives_size_and_frames_and_the_reference_count_is_in_both_keys(info):
    video = source_video(16, 9)
    request = SMALL.request("r", "a cat", 2, 1).resolve(info)
    bare = Family("wan-vace", size=16, frames=9).request("t", "a cat", 2, 1).resolve(info)
    assert request.step_key != bare.step_key and request.batch_key != bare.batch_key
    same = SMALL.request("s", "a dog", 2, 2)
    same.video_input = VideoInput(video.frames[:, ::-1].copy(), None, video.references)
    assert same.resolve(info).step_key == request.step_key          # another video, as many references: one tick
    unsized = Family("wan-vace", size=16, frames=9, video_input=True).request("u", "a cat", 2, 1)
    unsized.sampling = unsized.sampling.model_copy(update={"height": None, "width": None, "num_frames": None})
    s = unsized.resolve(info).sampling
    assert (s.height, s.width, s.num_frames) == (16, 16, 9)


def _refused(info, video: VideoInput, **fields) -> str:
    request = SMALL.request("r", "a cat", 2, 1, **fields)
    request.video_input = video
    with pytest.raises(InvalidRequestError) as caught:
        request.resolve(info)
    return str(caught.value)


def test_admission_refuses_a_video_it_cannot_condition_on_naming_the_upload(info):
    video = source_video(16, 9)
    frame = video.frames[0]
    assert _refused(info, VideoInput(video.frames[:8])).startswith("input_video='8 frames': WanVACEPipeline takes 4k+1")
    assert _refused(info, VideoInput(video.frames[:5])).startswith("num_frames=9: must be input_video's frame count (5)")
    assert _refused(info, VideoInput(video.frames, video.mask[:5])).startswith(
        "mask_video='5 frames': must have input_video's 9 frames")
    assert _refused(info, VideoInput(None, video.mask)).startswith("mask_video='<upload>': a mask video needs")
    assert _refused(info, VideoInput(None, None, (frame,) * 9)).startswith(
        "reference_image[8]='<file>': WanVACEPipeline takes at most 8 reference images (got 9)")
    wide = np.concatenate([video.frames, video.frames], axis=2)        # 32x16: conditioned at 16x8, not 16x16
    assert _refused(info, VideoInput(wide)).startswith("input_video='32x16': WanVACEPipeline would condition on it at "
                                                       "16x0")


def test_a_video_on_a_family_without_video_input_is_refused_naming_the_field(tiny_wan_path):
    engine = make_engine(tiny_wan_path, warmup=False)
    try:
        request = Family("wan", size=16, frames=9).request("r", "a cat", 2, 1)
        request.video_input = source_video(16, 9)
        with pytest.raises(InvalidRequestError, match=r"^input_video='<upload>': WanPipeline takes no source video"):
            engine.add_request(request)
        assert_no_state(engine)
    finally:
        engine.close()


def test_requests_with_and_without_a_video_share_ticks_each_equal_to_its_bare_call(tiny_wan_vace_path):
    """Step mode: a video-to-video request and a text-only one (the VACE branch on a zero video) with the same
    reference count share every forward; each equals WanVACEPipeline's own call, and the video conditions."""
    plain = Family("wan-vace", call=vace_call, size=16, frames=9, one_generator=True, per_video=True)
    engine = make_engine(tiny_wan_vace_path, "step", warmup=False, max_num_seqs=2)
    calls = count_denoiser_calls(engine)
    try:
        no_refs = SMALL.request("video", "a red car", 3, 2, guidance_scale=5.0)
        no_refs.video_input = VideoInput(no_refs.video_input.frames, no_refs.video_input.mask)
        with engine._lock:
            text = engine.add_request(plain.request("text", "a red car", 3, 1, guidance_scale=5.0))
            video = engine.add_request(no_refs)
        got = {"text": text.result(timeout=120).images, "video": video.result(timeout=120).images}
        assert_no_state(engine)
    finally:
        engine.close()
    assert calls[0] == 3, f"{calls[0]} forwards for two 3-step requests admitted together"
    assert max_diff(got["text"], bare_call(plain, tiny_wan_vace_path, "a red car", 3, 1, 5.0)) <= 2
    keywords = {k: v for k, v in video_keywords(source_video(16, 9)).items() if k != "reference_images"}
    assert max_diff(got["video"], bare_call(plain, tiny_wan_vace_path, "a red car", 3, 2, 5.0, **keywords)) <= 2


def test_the_video_conditions_every_forward(tiny_wan_vace_path, info):
    """The tiny random VACE branch moves the decoded video by a few uint8 only, so the step is checked: the same
    noise and prompt with and without the source video give predictions far apart (the control latents differ)."""
    adapter = resolve_adapter_class(ModelConfig(path=tiny_wan_vace_path)).load(tiny_wan_vace_path, torch.device("cpu"))
    plain = Family("wan-vace", size=16, frames=9)
    with_video = SMALL.request("v", "a red car", 3, 2)
    with_video.video_input = VideoInput(with_video.video_input.frames, with_video.video_input.mask)
    states = [adapter.prepare_encode(r.resolve(info)) for r in (plain.request("t", "a red car", 3, 2), with_video)]
    assert torch.equal(states[0].latents, states[1].latents)
    assert (states[0].cond["control"] - states[1].cond["control"]).abs().max() > 0.5
    text, video = adapter.denoise_step(states)
    assert (text - video).abs().max() > 1e-2
