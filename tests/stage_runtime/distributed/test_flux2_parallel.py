"""FLUX.2 on 2 real gloo ranks equals one plain rank: CFG parallel (Klein: [negative; prompt] rows of one forward
split across the ranks), Ulysses 2 and ring 2 (FLUX.2 [dev] and Klein: both token streams of every double- and
single-stream block cut, models/families/flux2.py) — images within 2 uint8 in request mode (a fused call of two
requests, a single request) and step mode (different step counts batched), at the default guidance and at 1 (Klein:
guided and unguided rows), and the transformer called directly on uneven and too-short token counts within 1e-5.

One spawn of 2 ranks for the module; the single-rank references are computed meanwhile. FLUX.2 [dev]'s CFG
parallel and either family's tensor parallel are refused at load (tests/stage_runtime/models/test_flux2.py).
"""

from __future__ import annotations

import dist_rank_checks as checks
import flux2_rank_checks as flux2
import pytest
from parallel_equality import check_denoiser_outputs, check_images

KINDS = ("flux2", "flux2-klein")
SEQUENCE_PARALLEL = ("ulysses", "ring")
# tiny FLUX.2: 1 double-stream + 2 single-stream blocks, each one attention
PROCESSORS = {"double": 1, "single": 2}


@pytest.fixture(scope="module")
def runs(tiny_flux2_path, tiny_flux2_klein_path):
    """({"cfg" | "ulysses" | "ring": {rank: payload}}, single-rank references), from ONE spawn of 2 ranks."""
    paths = {"flux2": tiny_flux2_path, "flux2-klein": tiny_flux2_klein_path}
    plan = {"cfg": {"parallel": {"cfg_parallel_size": 2}, "models": {"flux2-klein": tiny_flux2_klein_path}},
            "ulysses": {"parallel": {"ulysses_degree": 2}, "models": paths},
            "ring": {"parallel": {"ring_degree": 2}, "models": paths}}
    ranks = flux2.Ranks(2, list(plan.values()))
    try:
        references = {}
        for kind, path in paths.items():
            adapter = checks.load_adapter(path)
            references[kind], references[f"{kind}-hook-calls"] = checks.counting_denoiser_hooks(adapter,
                                                                                                checks.scenarios)
            references[f"{kind}-transformer"] = flux2.transformer_outputs(adapter)
    finally:
        payloads = ranks.wait(timeout_s=400)
    return {name: {rank: payloads[rank][i] for rank in payloads} for i, name in enumerate(plan)}, references


def test_klein_cfg_parallel_is_installed_and_equals_one_rank(runs):
    by_run, references = runs
    payloads = by_run["cfg"]
    assert payloads[0]["flux2-klein-installed"] == payloads[1]["flux2-klein-installed"] == {
        "cfg": True, "double": 0, "single": 0}
    check_images(payloads, references, "flux2-klein")
    check_denoiser_outputs(payloads, references, "flux2-klein")
    # one (full) denoiser call per step on every rank, as on one rank: the guided rows are one call
    assert payloads[0]["flux2-klein-hook-calls"] == payloads[1]["flux2-klein-hook-calls"] == \
        references["flux2-klein-hook-calls"] > 0


@pytest.mark.parametrize("run", SEQUENCE_PARALLEL)
@pytest.mark.parametrize("kind", KINDS)
def test_sequence_parallel_is_installed_on_every_attention_and_equals_one_rank(runs, kind, run):
    by_run, references = runs
    payloads = by_run[run]
    for rank in (0, 1):
        assert payloads[rank][f"{kind}-installed"] == {"cfg": False, **PROCESSORS}
    check_images(payloads, references, kind)
    assert payloads[0][f"{kind}-hook-calls"] == references[f"{kind}-hook-calls"]


@pytest.mark.parametrize("run", SEQUENCE_PARALLEL)
@pytest.mark.parametrize("kind", KINDS)
def test_transformer_outputs_equal_one_rank_on_uneven_and_short_sequences(runs, kind, run):
    by_run, references = runs
    assert sorted(references[f"{kind}-transformer"]) == ["1-tokens", "16-tokens", "9-tokens"]
    check_denoiser_outputs(by_run[run], references, kind)


@pytest.mark.parametrize("run", SEQUENCE_PARALLEL)
@pytest.mark.parametrize("kind", KINDS)
def test_a_replaced_processor_is_refused_not_silently_wrong(runs, kind, run):
    for rank in (0, 1):
        error = runs[0][run][rank][f"{kind}-replaced"]
        assert error is not None and "after enable_ulysses()" in error and "Flux2UlyssesSingleProcessor" in error, error


def test_scenarios_cover_request_and_step_mode_with_and_without_guidance(runs):
    _, references = runs
    for kind in KINDS:
        modes = {name.split("/")[0] for name in references[kind]}
        assert {m.split("-")[0] for m in modes} == {"request", "request1", "step"}
        assert any(m.endswith("-g1") for m in modes) and any(not m.endswith("-g1") for m in modes)
