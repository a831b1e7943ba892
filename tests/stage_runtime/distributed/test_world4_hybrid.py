"""World 4 on gloo: Ulysses 2 × ring 2 (hybrid sequence parallel; tiny DiT, SD3, Qwen-Image, Wan and
HunyuanVideo-1.5, whose denoisers are also compared in float) and TP 2 × CFG 2
(DiT, SD3) give the images of one plain rank (within 2 uint8), in request and step mode, with and without guidance.

Rank layout (stage_runtime.config, tp fastest): under ulysses 2 × ring 2 the sp coordinate is the rank,
Ulysses groups [0, 1] [2, 3] (inside), ring groups [0, 2] [1, 3] (across); under TP 2 × CFG 2 the tp
groups are [0, 1] [2, 3] and the cfg groups [0, 2] [1, 3]. One spawn of 4 ranks for the module.
"""

from __future__ import annotations

import parallel_rank_checks as prc
import pytest
from parallel_equality import check_denoiser_outputs, check_images

MODELS = ("dit", "sd3")
VIDEO = ("wan", "hunyuan-video15")
USP_MODELS = (*MODELS, "qwen-image", *VIDEO)
SP_PROCESSORS = {"dit": 2, "sd3": 3, "qwen-image": 2, "wan": 2, "hunyuan-video15": 1}
TP_ROW_LAYERS, HEADS = {"dit": 4, "sd3": 7}, {"dit": 4, "sd3": 2}
USP = {"ulysses_degree": 2, "ring_degree": 2}


@pytest.fixture(scope="module")
def runs(tiny_dit_path, tiny_sd3_path, tiny_qwen_image_path, tiny_wan_path, tiny_hunyuan_video15_path):
    paths = {"dit": tiny_dit_path, "sd3": tiny_sd3_path, "qwen-image": tiny_qwen_image_path, "wan": tiny_wan_path,
             "hunyuan-video15": tiny_hunyuan_video15_path}
    plan = {"kernel": {"job": "kernels", "parallel": USP},
            "usp": {"job": "models", "parallel": USP, "models": paths},
            "tp-cfg": {"job": "models", "parallel": {"tensor_parallel_size": 2, "cfg_parallel_size": 2},
                       "models": {kind: paths[kind] for kind in MODELS}}}
    return prc.spawn(4, plan, paths)


def pair(payloads: dict, rank: int) -> dict:
    """check_images compares ranks 0 and 1; give it this rank as '1' (every rank returns the gathered image)."""
    return {0: payloads[0], 1: payloads[rank]}


def test_hybrid_kernel_layout_and_uneven_chunks(runs):
    by_run, _ = runs
    kernel = by_run["kernel"]
    assert [(kernel[r]["sp_rank"], kernel[r]["ring_rank"]) for r in range(4)] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    for payload in kernel.values():
        assert payload["counts"] == [10, 9, 9, 9] and payload["max_error"] < 1e-4, payload
        assert set(payload["bytes"]) == {"all_to_all", "ring_send"}


def test_hybrid_kernel_with_a_key_mask_equals_masked_attention_even_where_a_ring_block_is_masked_whole(runs):
    by_run, _ = runs
    for payload in by_run["kernel"].values():
        assert payload["masked_error"] < 1e-4, payload


@pytest.mark.parametrize("kind", USP_MODELS)
def test_ulysses_times_ring_equals_one_rank(runs, kind):
    by_run, references = runs
    payloads = by_run["usp"]
    for rank in range(4):
        got = payloads[rank][f"{kind}-installed"]
        assert (got["sp"], got["ulysses"], got["ring"], got["cfg"]) == (SP_PROCESSORS[kind], [2], [2], False)
    for rank in (1, 2, 3):
        check_images(pair(payloads, rank), references, kind)


@pytest.mark.parametrize("kind", VIDEO)
def test_ulysses_times_ring_video_denoiser_outputs_equal_one_rank(runs, kind):
    by_run, references = runs
    assert sorted(references[f"{kind}-transformer"]) == ["1-tokens", "12-tokens", "9-tokens"]
    check_denoiser_outputs(by_run["usp"], references, kind)


@pytest.mark.parametrize("kind", MODELS)
def test_tensor_parallel_times_cfg_parallel_equals_one_rank(runs, kind):
    by_run, references = runs
    payloads = by_run["tp-cfg"]
    assert [payloads[r]["coords"][1:] for r in range(4)] == [(0, 0, 0, 0, 0), (1, 0, 0, 0, 0),
                                                             (0, 0, 0, 1, 0), (1, 0, 0, 1, 0)]
    for rank in range(4):
        got = payloads[rank][f"{kind}-installed"]
        assert (got["cfg"], got["tp_row_layers"], got["heads"]) == (True, TP_ROW_LAYERS[kind], [HEADS[kind] // 2])
    for rank in (1, 2, 3):
        check_images(pair(payloads, rank), references, kind)
