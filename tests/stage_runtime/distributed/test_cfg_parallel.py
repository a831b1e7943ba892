"""CFG parallel on 2 real gloo ranks gives the images of one plain rank (request mode and step mode, SD and DiT).

Scenarios (see dist_rank_checks.scenarios): a fused request-mode call of two requests, a single request,
and the step contract with two requests of different step counts (1 and 2 images) batched — each with
guidance > 1 ([uncond; cond] rows split across the ranks) and guidance 1 (one row per image: 2 rows split,
3 rows padded, 1 row computed whole on every rank).
"""

from __future__ import annotations

import pytest
from parallel_equality import check_images, check_scenarios_cover_the_brief, kind_param


@pytest.fixture(scope="module")
def outcome(two_rank_runs):
    """(payload per rank, references): the session's 2 ranks under the cfg topology."""
    by_run, references = two_rank_runs
    return by_run["cfg"], references


def test_topology_seen_by_each_rank(outcome):
    payloads, _ = outcome
    # layout tp-sp-pp-cfg-dp: rank r has cfg coordinate r; both ranks form one replica led by rank 0.
    assert payloads[0]["groups"] == {"coords": (0, 0, 0, 0, 0, 0), "leader": True, "replica_ranks": [0, 1],
                                     "dp": (0, 1)}
    assert payloads[1]["groups"] == {"coords": (1, 0, 0, 0, 1, 0), "leader": False, "replica_ranks": [0, 1],
                                     "dp": (0, 1)}


@kind_param
def test_cfg_parallel_is_installed(outcome, kind):
    payloads, _ = outcome
    assert payloads[0][f"{kind}-installed"] == payloads[1][f"{kind}-installed"] == {"cfg": True, "ulysses": 0}


def test_scenarios_cover_guidance_and_modes(outcome):
    check_scenarios_cover_the_brief(outcome[1])


@kind_param
def test_cfg_parallel_images_equal_single_rank(outcome, kind):
    check_images(*outcome, kind)


@kind_param
def test_denoiser_pre_hooks_fire_once_per_denoiser_call(outcome, kind):
    """The CFG wrapper replaces forward, not the module: hooks see each (full) call exactly once."""
    payloads, references = outcome
    assert references[f"{kind}-hook-calls"] > 0
    assert payloads[0][f"{kind}-hook-calls"] == payloads[1][f"{kind}-hook-calls"] == references[f"{kind}-hook-calls"]
