"""CFG-parallel (SD3) and joint Ulysses (SD3, FLUX) on 2 real gloo ranks give the images of one plain rank.

Scenarios (dist_rank_checks.scenarios): a fused request-mode call of two requests, a single request, and
the step contract with two requests of different step counts batched — at the family's default guidance
and at guidance 1. Under Ulysses every attention of both transformers runs sharded: SD3's text is
77 + 256 = 333 tokens (uneven chunks 167/166), FLUX's 512 text + 256 image tokens (even).
"""

from __future__ import annotations

import dist_rank_checks as checks
import joint_rank_checks as joint
import pytest
from parallel_equality import check_images

# tiny SD3: 2 blocks x (attn + attn2 in block 0); tiny FLUX: 1 double + 1 single block.
ULYSSES_PROCESSORS = {"sd3": 3, "flux": 2}


@pytest.fixture(scope="module")
def runs(tiny_sd3_path, tiny_flux_path):
    """({"cfg" | "ulysses": {rank: payload}}, single-rank references), from ONE spawn of 2 ranks."""
    plan = {"cfg": {"parallel": {"cfg_parallel_size": 2}, "models": {"sd3": tiny_sd3_path}},
            "ulysses": {"parallel": {"ulysses_degree": 2}, "models": {"sd3": tiny_sd3_path, "flux": tiny_flux_path}}}
    ranks = joint.Ranks(2, list(plan.values()))
    try:
        references = {}
        for kind, path in (("sd3", tiny_sd3_path), ("flux", tiny_flux_path)):
            adapter = checks.load_adapter(path)
            references[kind], references[f"{kind}-hook-calls"] = checks.counting_denoiser_hooks(adapter,
                                                                                                checks.scenarios)
    finally:
        payloads = ranks.wait(timeout_s=300)
    return {name: {rank: payloads[rank][i] for rank in payloads} for i, name in enumerate(plan)}, references


def test_sd3_cfg_parallel_is_installed_and_equals_one_rank(runs):
    by_run, references = runs
    payloads = by_run["cfg"]
    assert payloads[0]["sd3-installed"] == payloads[1]["sd3-installed"] == {"cfg": True, "ulysses": 0}
    check_images(payloads, references, "sd3")
    assert payloads[0]["sd3-hook-calls"] == payloads[1]["sd3-hook-calls"] == references["sd3-hook-calls"] > 0


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_joint_ulysses_is_installed_on_every_attention(runs, kind):
    payloads = runs[0]["ulysses"]
    expected = {"cfg": False, "ulysses": ULYSSES_PROCESSORS[kind]}
    assert payloads[0][f"{kind}-installed"] == payloads[1][f"{kind}-installed"] == expected


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_joint_ulysses_images_equal_one_rank_in_request_and_step_mode(runs, kind):
    by_run, references = runs
    names = set(references[kind])
    assert {n.split("-")[0] for n in names} == {"request", "request1", "step"}
    check_images(by_run["ulysses"], references, kind)


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_a_replaced_joint_processor_is_refused_not_silently_wrong(runs, kind):
    for rank in (0, 1):
        error = runs[0]["ulysses"][rank][f"{kind}-replaced"]
        assert error is not None and "after enable_ulysses()" in error and "JointUlyssesProcessor" in error, error

