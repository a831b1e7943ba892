"""Ulysses sequence parallel (degree 2) on 2 real gloo ranks gives the images of one plain rank
(request mode and step mode, SD and DiT).

Scenarios (see dist_rank_checks.scenarios): a fused request-mode call of two requests, a single request,
and the step contract with two requests of different step counts batched — each with guidance > 1
and guidance 1. Every self-attention of the UNet's transformers / DiT runs sharded (tokens 256 % 2 == 0).
"""

from __future__ import annotations

import pytest
from parallel_equality import check_denoiser_outputs, check_images, check_scenarios_cover_the_brief, kind_param

# self-attentions: tiny SD has 4 Transformer2DModels (1 down, 1 mid, 2 up) of one block; tiny DiT has 2 blocks.
ULYSSES_PROCESSORS = {"sd": 4, "dit": 2}


@pytest.fixture(scope="module")
def outcome(two_rank_runs):
    """(payload per rank, references): the session's 2 ranks under the ulysses topology."""
    by_run, references = two_rank_runs
    return by_run["ulysses"], references


def test_topology_seen_by_each_rank(outcome):
    payloads, _ = outcome
    # layout tp-sp-pp-cfg-dp: rank r has sp coordinate r; both ranks form one replica led by rank 0.
    assert payloads[0]["groups"] == {"coords": (0, 0, 0, 0, 0, 0), "leader": True, "replica_ranks": [0, 1],
                                     "dp": (0, 1)}
    assert payloads[1]["groups"] == {"coords": (1, 0, 1, 0, 0, 0), "leader": False, "replica_ranks": [0, 1],
                                     "dp": (0, 1)}


@kind_param
def test_ulysses_is_installed(outcome, kind):
    payloads, _ = outcome
    expected = {"cfg": False, "ulysses": ULYSSES_PROCESSORS[kind]}
    assert payloads[0][f"{kind}-installed"] == payloads[1][f"{kind}-installed"] == expected


def test_scenarios_cover_guidance_and_modes(outcome):
    check_scenarios_cover_the_brief(outcome[1])


@kind_param
def test_ulysses_images_equal_single_rank(outcome, kind):
    check_images(*outcome, kind)


def test_transformer_sharded_and_unsharded_sequences_equal_single_rank(outcome):
    """16 tokens run sharded (8 per rank), 9 tokens (not divisible by 2) fall back to unsharded on both ranks."""
    payloads, references = outcome
    assert sorted(references["sd-transformer"]) == ["3x3", "4x4"]
    check_denoiser_outputs(payloads, references, "sd")


@kind_param
def test_a_replaced_processor_is_refused_not_silently_wrong(outcome, kind):
    payloads, _ = outcome
    for rank in (0, 1):
        error = payloads[rank][f"{kind}-replaced"]
        assert error is not None and "was replaced by AttnProcessor2_0 after enable_ulysses()" in error, error
