"""Two real gloo ranks, spawned ONCE per session for every 2-rank test here (importing torch+diffusers
costs ~5 s per process). The ranks run, each in a freshly initialised world: the equality scenarios
under CFG parallel, then under Ulysses; then a lost-peer check where rank 1 stalls past the timeout,
then one where rank 1's process exits. The single-rank references are computed here meanwhile."""

from __future__ import annotations

import pytest

CFG2 = {"cfg_parallel_size": 2}
CFG_ONLY = ("ltx2",)        # families that run CFG parallel but no Ulysses (refused at load)


@pytest.fixture(scope="session")
def two_rank_runs(tiny_sd_path, tiny_dit_path, tiny_sdxl_path, tiny_qwen_image_path, tiny_wan_path, tiny_wan22_path,
                  tiny_wan_ti2v_path, tiny_wan_i2v_path, tiny_wan22_i2v_path, tiny_ltx2_path,
                  tiny_hunyuan_video15_path, tiny_hunyuan_video15_i2v_path,
                  tiny_wan_vace_path) -> tuple[dict[str, dict[int, dict]], dict]:
    """({run name: {rank: payload}}, references): references hold per kind the single-rank images,
    under ``<kind>-transformer`` the outputs of one directly called transformer (SD) or denoiser (Wan,
    HunyuanVideo-1.5), and
    under ``<kind>-hook-calls`` how often a forward pre-hook on the denoiser fires during the scenarios."""
    import dist_rank_checks as checks

    paths = {"sd": tiny_sd_path, "dit": tiny_dit_path, "sdxl": tiny_sdxl_path, "qwen-image": tiny_qwen_image_path,
             "wan": tiny_wan_path, "wan22": tiny_wan22_path, "wan-ti2v": tiny_wan_ti2v_path,
             "wan-i2v": tiny_wan_i2v_path, "wan22-i2v": tiny_wan22_i2v_path, "ltx2": tiny_ltx2_path,
             "hunyuan-video15": tiny_hunyuan_video15_path, "hunyuan-video15-i2v": tiny_hunyuan_video15_i2v_path,
             "wan-vace": tiny_wan_vace_path}
    runs = {
        "cfg": {"job": "models", "parallel": CFG2, "models": paths},
        "ulysses": {"job": "models", "parallel": {"ulysses_degree": 2},
                    "models": {kind: path for kind, path in paths.items() if kind not in CFG_ONLY}},
        "peer-stall": {"job": "peer_gone", "parallel": CFG2, "peer": "stall", "timeout_s": checks.PEER_TIMEOUT_S},
        "peer-exit": {"job": "peer_gone", "parallel": CFG2, "peer": "exit", "timeout_s": checks.PEER_TIMEOUT_S},  # last
    }
    ranks = checks.Ranks(2, list(runs.values()))
    try:
        references = {}
        for kind, path in paths.items():
            adapter = checks.load_adapter(path)
            references[kind], references[f"{kind}-hook-calls"] = checks.counting_denoiser_hooks(adapter,
                                                                                                checks.scenarios)
            references[f"{kind}-transformer"] = checks.transformer_outputs(adapter)
    finally:
        payloads = ranks.wait(timeout_s=240)
    by_run = {name: {rank: payloads[rank][i] for rank in payloads} for i, name in enumerate(runs)}
    return by_run, references
