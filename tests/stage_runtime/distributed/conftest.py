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
    """({topology: {rank: payload}}, {kind: single-rank reference images})."""
    import dist_rank_checks as checks

    paths = {"sd": tiny_sd_path, "dit": tiny_dit_path}
    ranks = checks.Ranks(2, {"job": "models", "parallels": list(TOPOLOGIES.values()), "models": paths})
    try:
        references = {kind: checks.scenarios(checks.load_adapter(path)) for kind, path in paths.items()}
    finally:
        payloads = ranks.wait(timeout_s=240)
    by_topology = {name: {rank: payloads[rank][i] for rank in payloads} for i, name in enumerate(TOPOLOGIES)}
    return by_topology, references
