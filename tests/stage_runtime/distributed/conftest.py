"""Two real gloo ranks, spawned ONCE per session for every equality test (importing torch+diffusers
costs ~5 s per process): the ranks run the scenarios under CFG parallel, then re-initialise the world
and run them under Ulysses. The single-rank references are computed here meanwhile."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))   # dist_rank_checks: importable here and in spawned ranks

TOPOLOGIES = {"cfg": {"cfg_parallel_size": 2}, "ulysses": {"ulysses_degree": 2}}


@pytest.fixture(scope="session")
def two_rank_runs(tiny_sd_path, tiny_dit_path) -> tuple[dict[str, dict[int, dict]], dict]:
    """({topology: {rank: payload}}, references): per kind the single-rank images, and under
    ``<kind>-transformer`` the outputs of one directly called transformer (SD only)."""
    import dist_rank_checks as checks

    paths = {"sd": tiny_sd_path, "dit": tiny_dit_path}
    ranks = checks.Ranks(2, {"job": "models", "parallels": list(TOPOLOGIES.values()), "models": paths})
    try:
        adapters = {kind: checks.load_adapter(path) for kind, path in paths.items()}
        references = {kind: checks.scenarios(adapter) for kind, adapter in adapters.items()}
        references.update({f"{kind}-transformer": checks.transformer_outputs(adapter)
                           for kind, adapter in adapters.items()})
    finally:
        payloads = ranks.wait(timeout_s=240)
    by_topology = {name: {rank: payloads[rank][i] for rank in payloads} for i, name in enumerate(TOPOLOGIES)}
    return by_topology, references
