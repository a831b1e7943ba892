"""World 4 on gloo: CFG parallel × Ulysses (cfg=2, ulysses=2) and CFG parallel × DP (cfg=2, dp=2). The ranks
fork from the fork server (torch and diffusers imported once), so four of them fit the default run."""

from __future__ import annotations

import dist_rank_checks as checks


def test_cfg_times_ulysses_and_cfg_times_dp_equal_single_rank(tiny_sd_path, tiny_dit_path):
    paths = {"sd": tiny_sd_path, "dit": tiny_dit_path}
    ranks = checks.Ranks(4, [{"job": "models", "models": paths, "parallel": parallel} for parallel in (
        {"cfg_parallel_size": 2, "ulysses_degree": 2}, {"cfg_parallel_size": 2, "num_gpus": 4})])
    try:
        references = {kind: checks.scenarios(checks.load_adapter(path)) for kind, path in paths.items()}
    finally:
        payloads = ranks.wait(timeout_s=300)
    usp, dp = ({r: payloads[r][i] for r in range(4)} for i in range(2))
    # layout tp-sp-pp-cfg-dp: sp varies fastest, then cfg (then dp).
    assert [usp[r]["groups"]["coords"][1:] for r in range(4)] == [(0, 0, 0, 0, 0), (0, 1, 0, 0, 0),
                                                                  (0, 0, 0, 1, 0), (0, 1, 0, 1, 0)]
    assert [dp[r]["groups"]["replica_ranks"] for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [dp[r]["groups"]["leader"] for r in range(4)] == [True, False, True, False]
    for kind in paths:
        assert usp[0][f"{kind}-installed"] == {"cfg": True, "ulysses": {"sd": 4, "dit": 2}[kind]}
        assert not checks.image_mismatches(usp, references[kind], kind)
        assert not checks.image_mismatches(dp, references[kind], kind)
