"""CFG parallel for FLUX.1 on 2 real gloo ranks gives the images of one plain rank (within 2 uint8), every rank the
same: true CFG's [cond; negative] rows split across the ranks (request mode's step loop, step mode, inpainting),
and plain requests' rows too (a guidance-distilled pipeline call: the images split, padded when odd). One
(full) transformer call per step on every rank, as on one rank; FLUX's per-token position ids go whole to each
rank (``per_token``), never cut as rows."""

from __future__ import annotations

import dist_rank_checks as checks
import numpy as np
import pytest


@pytest.fixture(scope="module")
def runs(tiny_flux_path):
    """({rank: payload}, the single-rank images, the single-rank hook calls), from ONE spawn of 2 ranks."""
    import flux_rank_checks as flux

    ranks = checks.Ranks(2, [{"job": "flux", "parallel": {"cfg_parallel_size": 2}, "path": tiny_flux_path}],
                         jobs_module="flux_rank_checks")
    try:
        references, calls = checks.counting_denoiser_hooks(checks.load_adapter(tiny_flux_path), flux.scenarios)
    finally:
        payloads = ranks.wait(timeout_s=300)
    return {rank: payload[0] for rank, payload in payloads.items()}, references, calls


def test_cfg_parallel_is_installed_on_both_ranks(runs):
    payloads, _, _ = runs
    assert payloads[0]["installed"] and payloads[1]["installed"]


def test_every_scenario_equals_one_rank_and_both_ranks_return_the_same_images(runs):
    payloads, references, _ = runs
    assert sorted(references) == sorted(payloads[0]["images"]) == sorted(payloads[1]["images"])
    assert {name.split("/")[0] for name in references} == {"request-cfg", "request-plain", "request1-cfg",
                                                          "inpaint-cfg", "tokens-as-rows", "step"}
    assert all(image.std() > 10 for name, image in references.items() if name != "tokens-as-rows/e")
    assert checks.max_abs_diff(references["request-cfg/a"], references["request-plain/a"]) > 10   # true CFG counts
    for name, reference in references.items():
        for rank in (0, 1):
            assert checks.max_abs_diff(payloads[rank]["images"][name], reference) <= 2, (rank, name)
        np.testing.assert_array_equal(payloads[0]["images"][name], payloads[1]["images"][name])


def test_one_full_transformer_call_per_step_on_every_rank(runs):
    payloads, _, calls = runs
    # request-cfg 2 (one forward a step for the wave), request-plain 2, request1-cfg 2, inpaint-cfg 3 (FLUX's rule:
    # 3 − int(3 − 3 × 0.8) = 3 steps), tokens-as-rows 1, step mode 3 (the 2-step request shares the first two ticks)
    assert payloads[0]["hook-calls"] == payloads[1]["hook-calls"] == calls == 13
