"""CFG-parallel (2 ranks) and Ulysses (degree 2) for SDXL, Qwen-Image, Wan (2.1, 2.2 with its two experts
and two guidance scales, TI2V-5B, I2V with its picture, 2.2 I2V A14B with both) and HunyuanVideo-1.5 (text- and
image-to-video: its picture's SigLIP tokens valid in the context, its latents beside the noise) give the images of
one plain rank (within 2 uint8) in request mode and step mode, with and without guidance (true-CFG rows for
Qwen-Image; guider rows for HunyuanVideo-1.5); CFG parallel for LTX-2 too (rows of four guidance passes, text- and
image-to-video requests in the same forwards), whose Ulysses is refused at load. Wan VACE's requests carry a source
video, its mask and a reference image: under CFG parallel each row's control latents split with it, under Ulysses
its control branch is sharded as the video (2 VACE blocks beside the 2 Wan blocks; its denoiser is called directly
too, with random control latents).

The ranks are the session's two gloo ranks of conftest.two_rank_runs (they load every family once per run).
Qwen-Image's Ulysses shards the image tokens of its dual-stream blocks and attends over [text ; image]
(models/families/qwen_image.py); SDXL's UNet transformer blocks take the UNet path of distributed/ulysses.py;
Wan's video tokens are sharded in each expert, cross-attention to the whole text stays local
(models/families/wan_ulysses.py). The tiny Wan's videos hardly depend on its transformer, so Wan's denoiser is also
called directly (denoiser_outputs.wan_outputs: rows on both sides of Wan 2.2's expert boundary, 12, 9 and 1
video tokens) and compared in float. HunyuanVideo-1.5's Ulysses cuts both streams of its joint [video ‖ context]
attention (models/families/hunyuan_video15.py); its tiny videos barely show guidance, so its transformer is
called directly too (denoiser_outputs.hunyuan_outputs: context masks of different lengths per row, 12, 9 and 1
video tokens).
"""

from __future__ import annotations

import pytest
from parallel_equality import check_denoiser_outputs, check_images

WAN = ("wan", "wan22", "wan-ti2v", "wan-i2v", "wan22-i2v", "wan-vace")
VIDEO = (*WAN, "hunyuan-video15", "hunyuan-video15-i2v")
ULYSSES_FAMILIES = ("sdxl", "qwen-image", *VIDEO)
FAMILIES = (*ULYSSES_FAMILIES, "ltx2")
# self-attentions under Ulysses: tiny SDXL has 4 Transformer2DModels of one block (1 down, 1 mid, 2 up);
# tiny Qwen-Image has 2 dual-stream blocks; tiny Wan 2 blocks per transformer (Wan 2.2: 2 experts); tiny
# HunyuanVideo-1.5 1 dual-stream block.
ULYSSES_PROCESSORS = {"sdxl": 4, "qwen-image": 2, "wan": 2, "wan22": 4, "wan-ti2v": 2, "wan-i2v": 2,
                      "wan22-i2v": 4, "wan-vace": 4, "hunyuan-video15": 1, "hunyuan-video15-i2v": 1}
family_param = pytest.mark.parametrize("kind", FAMILIES)
ulysses_param = pytest.mark.parametrize("kind", ULYSSES_FAMILIES)


@pytest.fixture(scope="module")
def runs(two_rank_runs):
    return two_rank_runs


@family_param
def test_scenarios_cover_modes_and_guidance(runs, kind):
    names = set(runs[1][kind])
    for mode in ("request", "request1", "step"):
        assert any(n.startswith(f"{mode}-g1/") for n in names), mode
        assert any(n.startswith(f"{mode}-g") and not n.startswith(f"{mode}-g1/") for n in names), mode


@family_param
def test_cfg_parallel_is_installed_and_equals_one_rank(runs, kind):
    by_run, references = runs
    payloads = by_run["cfg"]
    assert payloads[0][f"{kind}-installed"] == payloads[1][f"{kind}-installed"] == {"cfg": True, "ulysses": 0}
    check_images(payloads, references, kind)
    # one (full) denoiser call per step on every rank, as on one rank: true-CFG rows are one call
    assert payloads[0][f"{kind}-hook-calls"] == payloads[1][f"{kind}-hook-calls"] == references[f"{kind}-hook-calls"]


@ulysses_param
def test_ulysses_is_installed_and_equals_one_rank(runs, kind):
    by_run, references = runs
    payloads = by_run["ulysses"]
    expected = {"cfg": False, "ulysses": ULYSSES_PROCESSORS[kind]}
    assert payloads[0][f"{kind}-installed"] == payloads[1][f"{kind}-installed"] == expected
    check_images(payloads, references, kind)


@pytest.mark.parametrize("run", ["cfg", "ulysses"])
@pytest.mark.parametrize("kind", VIDEO)
def test_video_denoiser_outputs_equal_one_rank(runs, run, kind):
    by_run, references = runs
    assert sorted(references[f"{kind}-transformer"]) == ["1-tokens", "12-tokens", "9-tokens"]
    check_denoiser_outputs(by_run[run], references, kind)


@ulysses_param
def test_ulysses_refuses_a_replaced_processor(runs, kind):
    payloads = runs[0]["ulysses"]
    for rank in (0, 1):
        error = payloads[rank][f"{kind}-replaced"]
        assert error is not None and "after enable_ulysses()" in error and "was replaced by" in error, error
