"""CFG parallel (2 real gloo ranks) for Qwen-Image-Edit and Edit-Plus gives the edits of one plain rank (within
2 uint8): a request-mode wave of two guided edits and the step loop with a guided and an unguided edit batched
(qwen_edit_rank_checks.scenarios: the true-CFG rows, the picture tokens and the per-row timesteps split across
the ranks, padded when odd). One full transformer call per step on every rank, as on one. Ulysses and ring are
refused at load with the reason."""

from __future__ import annotations

import dist_rank_checks as checks
import pytest
import qwen_edit_rank_checks as qwen_edit
import numpy as np

from stage_runtime.config import ParallelConfig
from stage_runtime.distributed.apply import apply_parallelism
from stage_runtime.errors import ConfigError

KINDS = ("qwen-image-edit", "qwen-image-edit-plus")


@pytest.fixture(scope="module")
def runs(tiny_qwen_image_edit_path, tiny_qwen_image_edit_plus_path):
    """({rank: payload}, single-rank references), from ONE spawn of 2 ranks under cfg_parallel_size=2."""
    paths = dict(zip(KINDS, (tiny_qwen_image_edit_path, tiny_qwen_image_edit_plus_path), strict=True))
    ranks = qwen_edit.Ranks(2, [{"parallel": {"cfg_parallel_size": 2}, "models": paths}])
    try:
        references = {}
        for kind, path in paths.items():
            adapter = checks.load_adapter(path)
            references[kind], references[f"{kind}-hook-calls"] = checks.counting_denoiser_hooks(adapter,
                                                                                                qwen_edit.scenarios)
            references[f"{kind}-adapter"] = adapter
    finally:
        payloads = ranks.wait(timeout_s=900)
    return {rank: payloads[rank][0] for rank in payloads}, references


@pytest.mark.parametrize("kind", KINDS)
def test_cfg_parallel_edits_equal_one_rank(runs, kind):
    payloads, references = runs
    assert payloads[0][f"{kind}-installed"] == payloads[1][f"{kind}-installed"] == {"cfg": True, "ulysses": 0}
    ref = references[kind]
    assert sorted(ref) == ["request-g4/a", "request-g4/b", "step-mixed/s2", "step-mixed/s3"]
    assert all(img.std() > 5 for img in ref.values())                              # not trivial, and apart
    assert checks.max_abs_diff(ref["request-g4/a"], ref["request-g4/b"]) > 20
    assert not checks.image_mismatches(payloads, ref, kind, tol=2), checks.image_mismatches(payloads, ref, kind)
    for name in ref:                  # every rank returns the same (gathered) result
        np.testing.assert_array_equal(payloads[0][kind][name], payloads[1][kind][name])
    # 2 steps of the wave, then 3 ticks of the step loop: one (full) transformer call each, on every rank
    calls = {payloads[0][f"{kind}-hook-calls"], payloads[1][f"{kind}-hook-calls"], references[f"{kind}-hook-calls"]}
    assert calls == {5}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("topology", [{"ulysses_degree": 2}, {"ring_degree": 2}])
def test_sequence_parallelism_is_refused_with_the_reason(runs, kind, topology):
    adapter = runs[1][f"{kind}-adapter"]
    with pytest.raises(ConfigError, match=r"is not supported by QwenImageEdit.*untested with the input pictures"):
        apply_parallelism(adapter, None, ParallelConfig(**topology))
