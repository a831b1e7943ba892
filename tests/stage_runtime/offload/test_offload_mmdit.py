"""Layerwise offload on the MMDiT families: the adapter names the block lists (FLUX: double then single
blocks; SD3: its joint blocks), each block is one unit, and images equal no offload bitwise (request
mode and step mode), with nothing left resident afterwards."""

from __future__ import annotations

import numpy as np
import pytest
from offload_probes import make_runner, req, run_request, run_steps

BLOCKS = {"flux": ["transformer.block0", "transformer.block1"],      # 1 double-stream + 1 single-stream block
          "sd3": ["transformer.block0", "transformer.block1"]}


@pytest.fixture(params=["flux", "sd3"])
def family(request, tiny_flux_path, tiny_sd3_path):
    return request.param, {"flux": tiny_flux_path, "sd3": tiny_sd3_path}[request.param]


def test_layerwise_units_follow_the_family_block_lists(family):
    kind, path = family
    runner = make_runner(path, {"mode": "layerwise"})
    try:
        units = runner.offloader.units
        transformer = runner.adapter.pipe.transformer
        blocks = [u for u in units if u.kind == "block"]
        assert [u.name for u in blocks] == BLOCKS[kind]
        expected = [*transformer.transformer_blocks, *getattr(transformer, "single_transformer_blocks", [])]
        assert [u.modules[0] for u in blocks] == expected                   # in execution order
        assert "transformer.head" in {u.name for u in units}
    finally:
        runner.close()


def test_layerwise_offload_equals_no_offload_bitwise_in_request_and_step_mode(family):
    _, path = family
    plain, offloaded = make_runner(path), make_runner(path, {"mode": "layerwise"})
    try:
        for mode, run in (("request", run_request), ("step", run_steps)):
            request = lambda: req(f"{mode}-a", "a photo of a cat", steps=3, seed=5, height=64, width=64)  # noqa: E731
            expected, got = run(plain, request()), run(offloaded, request())
            assert expected.std() > 10
            assert np.array_equal(got, expected), f"{mode} mode differs under layerwise offload"
            assert offloaded.offloader.manager.measured_resident_bytes() == 0
        assert offloaded.offloader.stats()["units_loading"] == 0
    finally:
        plain.close()
        offloaded.close()
