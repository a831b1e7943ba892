"""World 8 on gloo: TP 2 × Ulysses 2 × CFG 2 in one world equals one plain rank (tiny DiT: 4 heads = TP 2 ×
Ulysses 2), request and step mode. The eight ranks fork from the fork server (torch and diffusers imported once)."""

from __future__ import annotations

import parallel_rank_checks as prc
from parallel_equality import check_images


def test_tp2_ulysses2_cfg2_equals_one_rank(tiny_dit_path):
    parallel = {"tensor_parallel_size": 2, "ulysses_degree": 2, "cfg_parallel_size": 2}
    by_run, references = prc.spawn(8, {"all": {"job": "models", "parallel": parallel,
                                               "models": {"dit": tiny_dit_path}}}, {"dit": tiny_dit_path}, 900)
    payloads = by_run["all"]
    # tp fastest, then sp, then cfg
    assert [payloads[r]["coords"][1:4] + payloads[r]["coords"][4:5] for r in range(8)] == [
        (t, s, 0, c) for c in range(2) for s in range(2) for t in range(2)]
    for rank in range(8):
        got = payloads[rank]["dit-installed"]
        assert (got["cfg"], got["tp_row_layers"], got["heads"], got["ulysses"], got["ring"]) == (
            True, 4, [2], [2], [1])
        check_images({0: payloads[0], 1: payloads[rank]}, references, "dit")
