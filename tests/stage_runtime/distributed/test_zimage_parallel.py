"""Z-Image on 2 real gloo ranks: CFG parallel (the transformer's list rows split, distributed/cfg_parallel_lists.py),
Ulysses 2 and ring 2 (the unified [image ‖ caption] sequence of every main layer cut, with the key mask of rows
padded to the longest: models/families/zimage.py) each give the images of one plain rank within 2 uint8 in
request and step mode (guided, weakly guided and unguided rows in one forward), and the transformer called
directly within 1e-4 (CFG 2: a rank's rows may all have one length and run without the key mask the full batch
needs, another SDPA path: ~1e-5 here; Ulysses 0, ring ~1e-6); tensor parallel is refused at load naming why.

One spawn of 2 ranks runs the three topologies in turn; the single-rank references are computed meanwhile.
"""

from __future__ import annotations

import dist_rank_checks as checks
import numpy as np
import pytest
import zimage_rank_checks as zc

from stage_runtime.config import ParallelConfig
from stage_runtime.distributed.apply import apply_parallelism
from stage_runtime.errors import ConfigError

TOPOLOGIES = {"cfg": {"cfg_parallel_size": 2}, "ulysses": {"ulysses_degree": 2}, "ring": {"ring_degree": 2}}
INSTALLED = {"cfg": {"cfg": True, "sp": 0, "ulysses": [], "ring": []},         # tiny Z-Image: 2 main layers
             "ulysses": {"cfg": False, "sp": 2, "ulysses": [2], "ring": [1]},
             "ring": {"cfg": False, "sp": 2, "ulysses": [1], "ring": [2]}}


@pytest.fixture(scope="module")
def runs(tiny_zimage_path):
    ranks = checks.Ranks(2, [{"job": "zimage", "parallel": parallel, "path": tiny_zimage_path, "timeout_s": 60}
                             for parallel in TOPOLOGIES.values()], jobs_module="zimage_rank_checks")
    try:
        reference = zc.references(tiny_zimage_path)
    finally:
        payloads = ranks.wait(timeout_s=400)
    return {name: {rank: payloads[rank][i] for rank in payloads} for i, name in enumerate(TOPOLOGIES)}, reference


def test_the_references_are_not_trivial(runs):
    _, reference = runs
    images = reference["images"]
    assert len(images) == 9 and all(img.std() > 10 for img in images.values())
    assert checks.max_abs_diff(images["request-g5/a"], images["request-g0/a"]) > 20       # guidance shows
    assert checks.max_abs_diff(images["request-g5/a"], images["request-g5/b"]) > 50
    assert reference["hook-calls"] == 2 * 4 + 3                   # one forward per step in every scenario


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_each_topology_is_installed_and_equals_one_rank(runs, topology):
    by_run, reference = runs
    payloads = by_run[topology]
    for rank, payload in payloads.items():
        assert payload["installed"] == INSTALLED[topology], rank
        assert payload["hook-calls"] == reference["hook-calls"], rank
        assert sorted(payload["images"]) == sorted(reference["images"])
        for name, expected in reference["images"].items():
            assert checks.max_abs_diff(payload["images"][name], expected) <= 2, (rank, topology, name)
            np.testing.assert_array_equal(payload["images"][name], payloads[1 - rank]["images"][name])
        for name, expected in reference["transformer"].items():
            np.testing.assert_allclose(payload["transformer"][name], expected, rtol=0, atol=1e-4,
                                       err_msg=f"rank {rank} {topology} {name}")


@pytest.mark.parametrize("topology", ["ulysses", "ring"])
def test_a_replaced_processor_is_refused(runs, topology):
    for rank, payload in runs[0][topology].items():
        error = payload["replaced"]
        assert error is not None and "after enable_ulysses()" in error and "was replaced by" in error, (rank, error)


def test_tensor_parallel_is_refused_naming_why(tiny_zimage_path):
    adapter = checks.load_adapter(tiny_zimage_path)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 is not supported by ZImagePipeline \(it runs: "
                                          r"cfg, ring, ulysses\): .*ZSingleStreamAttnProcessor.*SwiGLU"):
        apply_parallelism(adapter, None, ParallelConfig(tensor_parallel_size=2))
