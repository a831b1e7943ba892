"""Video requests: frames checked against the family's rule at admission (never rounded), defaults filled, the
video fields refused by image families, guidance_scale_2 only where there are two experts, frames in the cost, the
reference image where the family requires or allows one."""

from __future__ import annotations

import re

import numpy as np
import pytest

from support.factories import model_info

from stage_runtime.config import LimitsConfig
from stage_runtime.engine.limits import check_request_cost, max_request_cost, request_cost
from stage_runtime.errors import InvalidRequestError
from stage_runtime.request import DiffusionRequest, SamplingParams

WAN = model_info(pipeline_class="WanPipeline", default_height=480, default_width=832, size_multiple=16,
                 frame_rule=(4, 1), default_frames=81, default_fps=16)
WAN22 = model_info(pipeline_class="WanPipeline", default_height=480, default_width=832, size_multiple=16,
                   frame_rule=(4, 1), default_frames=81, default_fps=16, takes_guidance_2=True)
IMAGE = model_info()


def resolve(info, **sampling) -> SamplingParams:
    return DiffusionRequest("r", "a cat", SamplingParams(**sampling), video=info.video).resolve(info).sampling


def test_a_video_family_serves_video_requests_only_and_an_image_family_image_requests_only():
    with pytest.raises(InvalidRequestError, match=r"^model='WanPipeline': makes videos: ask for one on a video "
                                                  r"route \(POST /v1/videos/sync\)$"):
        DiffusionRequest("r", "a cat", SamplingParams(height=16, width=16)).resolve(WAN)
    with pytest.raises(InvalidRequestError, match=r"^model='StableDiffusionPipeline': makes images"):
        DiffusionRequest("r", "a cat", video=True).resolve(IMAGE)


def test_frames_and_fps_default_to_the_models():
    s = resolve(WAN, height=16, width=16)
    assert (s.num_frames, s.fps, s.guidance_scale_2) == (81, 16, None)
    s = resolve(WAN, height=16, width=16, num_frames=9, fps=24)
    assert (s.num_frames, s.fps) == (9, 24)


@pytest.mark.parametrize(("frames", "nearest"), [(10, "9, 13"), (8, "5, 9"), (2, "1, 5"), (80, "77, 81")])
def test_a_frame_count_off_the_rule_is_refused_naming_the_nearest_never_rounded(frames, nearest):
    with pytest.raises(InvalidRequestError, match=rf"^num_frames={frames}: WanPipeline takes 4k\+1 frames "
                                                  rf"\({nearest} are the nearest\)$") as caught:
        resolve(WAN, height=16, width=16, num_frames=frames)
    assert caught.value.field == "num_frames"


@pytest.mark.parametrize("field, value", [("num_frames", 9), ("fps", 16), ("guidance_scale_2", 3.0)])
def test_an_image_family_refuses_the_video_fields(field, value):
    with pytest.raises(InvalidRequestError, match=rf"^{field}={value!r}: StableDiffusionPipeline makes images"):
        resolve(IMAGE, **{field: value})


def test_guidance_scale_2_needs_two_experts():
    with pytest.raises(InvalidRequestError, match=r"^guidance_scale_2=3\.0: WanPipeline has one denoiser"):
        resolve(WAN, height=16, width=16, guidance_scale_2=3.0)
    assert resolve(WAN22, height=16, width=16, guidance_scale_2=3.0).guidance_scale_2 == 3.0


@pytest.mark.parametrize("field, value", [("num_frames", 0), ("num_frames", 1026), ("fps", 0), ("fps", 241)])
def test_frame_and_fps_bounds_are_checked_at_the_edge(field, value):
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams.parse({field: value})
    assert caught.value.field == field


def test_frames_count_in_the_cost_and_name_the_field_to_shrink():
    small = DiffusionRequest("a", "x", SamplingParams(height=480, width=832, num_frames=9,
                                                      num_inference_steps=10), video=True).resolve(WAN)
    assert request_cost(small) == 480 * 832 * 9 * 10
    limit = max_request_cost(LimitsConfig(), WAN)
    assert limit == 480 * 832 * 81 * 1000
    long = DiffusionRequest("b", "x", SamplingParams(height=480, width=832, num_frames=1025,
                                                     num_inference_steps=1000), video=True).resolve(WAN)
    with pytest.raises(InvalidRequestError, match=r"^num_frames=1025: 832x480 px x 1025 frames x 1000 steps") as e:
        check_request_cost(long, limit, WAN)
    assert e.value.field == "num_frames"


@pytest.mark.parametrize(("reference", "given", "error"), [
    ("required", False, "input_reference=None: I2VPipeline makes a video from an image: give one"),
    ("required", True, None), ("optional", False, None), ("optional", True, None),
    (None, False, None), (None, True, "input_reference='<image>': I2VPipeline takes no reference image")])
def test_a_reference_image_is_taken_where_the_family_requires_or_allows_one(reference, given, error):
    """``ModelInfo.reference``: "required" (Wan I2V), "optional" (LTX-2: with one, image-to-video), None (a 400)."""
    info = model_info(pipeline_class="I2VPipeline", size_multiple=16, frame_rule=(4, 1), default_frames=81,
                      default_fps=16, reference=reference)
    request = DiffusionRequest("r", "a cat", SamplingParams(height=16, width=16), video=True,
                               reference=np.zeros((16, 16, 3), np.uint8) if given else None)
    if error is None:
        assert request.resolve(info).reference is request.reference
        return
    with pytest.raises(InvalidRequestError, match=rf"^{re.escape(error)}$") as caught:
        request.resolve(info)
    assert caught.value.field == "input_reference"


# generate_crop_size_list(640, 16) at 480p, as HunyuanVideo-1.5 I2V's __call__ picks from (a few of them, in order)
BUCKETS_480P = ((1280, 320), (960, 400), (848, 480), (640, 640), (480, 848), (400, 960), (320, 1280))


@pytest.mark.parametrize(("picture", "size"), [
    ((720, 1280), (480, 848)),      # 16:9 landscape: the 16:9 bucket
    ((1280, 720), (848, 480)),      # portrait
    ((500, 500), (640, 640)),       # square
    ((600, 1280), (480, 848)),      # 0.469 wide: the nearest at least as tall (0.566), not the nearer 0.417
    ((1000, 200), (1280, 320))])    # taller than any: the tallest
def test_a_family_sized_by_its_picture_gives_a_request_without_a_size_the_pictures_bucket(picture, size):
    """``ModelInfo.reference_buckets`` (HunyuanVideo-1.5 I2V): the bucket of the nearest aspect ratio on the picture's
    side of square, as ``calculate_default_height_width``; a request's own size wins; other families keep theirs."""
    info = model_info(pipeline_class="I2VPipeline", default_height=480, default_width=848, size_multiple=16,
                      frame_rule=(4, 1), default_frames=121, default_fps=24, reference="required",
                      reference_buckets=BUCKETS_480P)
    reference = np.zeros((*picture, 3), np.uint8)
    s = DiffusionRequest("r", "a cat", video=True, reference=reference).resolve(info).sampling
    assert (s.height, s.width) == size
    s = DiffusionRequest("r", "a cat", SamplingParams(height=320, width=320), video=True,
                         reference=reference).resolve(info).sampling
    assert (s.height, s.width) == (320, 320)
    unbucketed = model_info(pipeline_class="I2VPipeline", default_height=480, default_width=848, size_multiple=16,
                            frame_rule=(4, 1), default_frames=121, default_fps=24, reference="required")
    s = DiffusionRequest("r", "a cat", video=True, reference=reference).resolve(unbucketed).sampling
    assert (s.height, s.width) == (480, 848)
