"""Ring attention (ring_degree 2) and tensor parallel (tensor_parallel_size 2) on 2 real gloo ranks give the
images of one plain rank (within 2 uint8) for tiny DiT, SD3 and FLUX.1 (MMDiTs, joint text+image
attention), and ring 2 for Qwen-Image (joint [text ‖ image] with a text key mask), Wan 2.1 / 2.2 / I2V / VACE (video
self-attention; I2V's picture tokens join the text in cross-attention; VACE's control branch sharded alike) and HunyuanVideo-1.5 (joint [video ‖
context] with a context mask; the video denoisers also called directly and compared in float) — in request mode
(a fused call of
two requests, a single request) and in step mode (two requests of different step counts batched), with and
without guidance.

One spawn of 2 ranks per module runs: the ring kernel against plain SDPA on an odd token count (uneven
blocks; without and with a key mask), then every model under ring 2, then under TP 2. The single-rank
references are computed meanwhile.
"""

from __future__ import annotations

import parallel_rank_checks as prc
import pytest
from parallel_equality import check_denoiser_outputs, check_images

TP_MODELS = ("dit", "sd3", "flux")
VIDEO = ("wan", "wan22", "wan-i2v", "wan-vace", "hunyuan-video15")
RING_MODELS = (*TP_MODELS, "qwen-image", *VIDEO)
# sequence-parallel attention processors: tiny DiT 2 blocks; SD3 2 blocks + attn2 of block 0; FLUX 1 + 1 blocks;
# Qwen-Image 2 dual-stream blocks; Wan 2 blocks per transformer (Wan 2.2: 2 experts); HunyuanVideo-1.5 1 block.
SP_PROCESSORS = {"dit": 2, "sd3": 3, "flux": 2, "qwen-image": 2, "wan": 2, "wan22": 4, "wan-i2v": 2,
                 "wan-vace": 4, "hunyuan-video15": 1}
# row-parallel layers under TP: DiT 2 × (to_out, ff); SD3 block 0: to_out, to_add_out, attn2.to_out, ff,
# ff_context; block 1 (context_pre_only): to_out, ff. FLUX double block: to_out, to_add_out, ff, ff_context;
# single block: proj_out over [attention ‖ MLP].
TP_ROW_LAYERS, HEADS = {"dit": 4, "sd3": 7, "flux": 5}, {"dit": 4, "sd3": 2, "flux": 2}


@pytest.fixture(scope="module")
def runs(tiny_dit_path, tiny_sd3_path, tiny_flux_path, tiny_qwen_image_path, tiny_wan_path, tiny_wan22_path,
         tiny_wan_i2v_path, tiny_wan_vace_path, tiny_hunyuan_video15_path):
    paths = {"dit": tiny_dit_path, "sd3": tiny_sd3_path, "flux": tiny_flux_path, "qwen-image": tiny_qwen_image_path,
             "wan": tiny_wan_path, "wan22": tiny_wan22_path, "wan-i2v": tiny_wan_i2v_path,
             "wan-vace": tiny_wan_vace_path, "hunyuan-video15": tiny_hunyuan_video15_path}
    plan = {"kernel": {"job": "kernels", "parallel": {"ring_degree": 2}},
            "ring": {"job": "models", "parallel": {"ring_degree": 2}, "models": {k: paths[k] for k in RING_MODELS}},
            "tp": {"job": "models", "parallel": {"tensor_parallel_size": 2},
                   "models": {k: paths[k] for k in TP_MODELS}}}
    return prc.spawn(2, plan, paths)


def test_ring_kernel_equals_full_attention_with_uneven_blocks(runs):
    by_run, _ = runs
    for rank, payload in by_run["kernel"].items():
        assert payload["counts"] == [19, 18] and payload["sp_rank"] == payload["ring_rank"] == rank
        assert payload["max_error"] < 1e-4, payload
        # one k/v block (2 × B 2 × H 4 × D 8 float32 per token) sent once around a ring of 2
        assert payload["bytes"] == {"ring_send": 2 * 2 * 4 * 8 * 4 * payload["counts"][rank]}


def test_ring_kernel_with_a_key_mask_equals_masked_attention_even_where_a_block_is_masked_whole(runs):
    by_run, _ = runs
    for payload in by_run["kernel"].values():
        assert payload["masked_error"] < 1e-4, payload


@pytest.mark.parametrize("kind", RING_MODELS)
def test_ring_is_installed_on_every_attention_and_equals_one_rank(runs, kind):
    by_run, references = runs
    payloads = by_run["ring"]
    for rank in (0, 1):
        got = payloads[rank][f"{kind}-installed"]
        assert (got["sp"], got["ring"], got["ulysses"], got["tp_row_layers"]) == (SP_PROCESSORS[kind], [2], [1], 0)
    check_images(payloads, references, kind)


@pytest.mark.parametrize("kind", VIDEO)
def test_ring_video_denoiser_outputs_equal_one_rank(runs, kind):
    by_run, references = runs
    assert sorted(references[f"{kind}-transformer"]) == ["1-tokens", "12-tokens", "9-tokens"]
    check_denoiser_outputs(by_run["ring"], references, kind)


@pytest.mark.parametrize("kind", TP_MODELS)
def test_tensor_parallel_shards_heads_and_mlp_and_equals_one_rank(runs, kind):
    by_run, references = runs
    payloads = by_run["tp"]
    for rank in (0, 1):
        got = payloads[rank][f"{kind}-installed"]
        assert (got["tp_row_layers"], got["heads"], got["sp"]) == (TP_ROW_LAYERS[kind], [HEADS[kind] // 2], 0)
    check_images(payloads, references, kind)


def test_scenarios_cover_request_and_step_mode_with_and_without_guidance(runs):
    _, references = runs
    for kind in RING_MODELS:
        modes = {name.split("/")[0] for name in references[kind]}
        assert {m.split("-")[0] for m in modes} == {"request", "request1", "step"}
        assert any(m.endswith("-g1") for m in modes) and any(not m.endswith("-g1") for m in modes)
