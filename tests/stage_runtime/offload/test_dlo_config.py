"""``offload.mode: distributed`` (DLO) in the stage config: what it needs of the topology and what it cannot be
combined with, each refusal naming the fields and values; the rank-local variant (``allgather: false``) is
layerwise offload on each rank."""

from __future__ import annotations

import pytest

from stage_runtime.config import load_config
from stage_runtime.errors import ConfigError


def cfg(offload=None, **sections):
    return load_config({"model": {"path": "/m"}, "offload": {"mode": "distributed", **(offload or {})}, **sections})


def test_dlo_on_two_data_parallel_ranks():
    c = cfg(parallel={"num_gpus": 2})
    assert c.offload.dlo and c.offload.allgather and c.parallel.dp_size == 2
    assert c.offload.per_rank_mode == "distributed"
    assert load_config(c.model_dump()) == c


def test_rank_local_variant_is_layerwise_per_rank():
    c = cfg({"allgather": False}, parallel={"num_gpus": 2})
    assert not c.offload.dlo and c.offload.per_rank_mode == "layerwise"


@pytest.mark.parametrize("sections, message", [
    ({}, r"offload.mode='distributed' shards the denoiser across data-parallel ranks, but world_size=1 .* dp=1; "
         r"give num_gpus \(or data_parallel_size\) > 1"),
    ({"parallel": {"num_gpus": 4, "cfg_parallel_size": 2}},
     r"offload.mode='distributed' with world_size=4 \(.* cfg=2 dp=2\): every rank must be its own data-parallel "
     r"replica"),
    ({"parallel": {"num_gpus": 2, "ulysses_degree": 2, "data_parallel_size": 1}}, r"has dp=1"),
    ({"parallel": {"num_gpus": 2}, "scheduler": {"execution_mode": "step"}},
     r"offload.mode='distributed' with execution_mode='step'.*use execution_mode='request'"),
    ({"parallel": {"num_gpus": 2}, "cache": {"mode": "block"}}, r"offload.mode='distributed' with cache.mode='block'"),
    ({"parallel": {"num_gpus": 2}, "compile": {"mode": "regional"}},
     r"compile.mode='regional' with offload.mode='distributed'"),
    ({"parallel": {"num_gpus": 2}, "quantization": {"method": "int8-weight"}},
     r"quantization.method='int8-weight' with offload.mode='distributed'"),
    ({"parallel": {"num_gpus": 2}, "sleep": {"enabled": True}}, r"sleep.enabled with offload.mode='distributed'"),
])
def test_refusals_name_the_fields(sections, message):
    with pytest.raises(ConfigError, match=message):
        cfg(**sections)


def test_prompt_cache_is_refused_only_over_a_gathered_text_encoder():
    assert cfg(parallel={"num_gpus": 2}, cache={"prompt_max_bytes": 10**6}).cache.prompt_max_bytes
    with pytest.raises(ConfigError, match=r"over a text encoder with cache.prompt_max_bytes > 0"):
        cfg({"components": ["unet", "text_encoder"]}, parallel={"num_gpus": 2}, cache={"prompt_max_bytes": 10**6})


@pytest.mark.parametrize("offload, message", [
    ({"mode": "layerwise", "allgather": False}, r"allgather=False only applies to mode='distributed'"),
    ({"mode": "distributed", "max_host_bytes": 10}, r"max_host_bytes=10 does not apply to mode='distributed'"),
    ({"mode": "distributed", "resident_layers": 1}, r"resident_layers=1 must be >= 2 with prefetch=True"),
])
def test_offload_field_rules(offload, message):
    with pytest.raises(ConfigError, match=message):
        load_config({"model": {"path": "/m"}, "offload": offload, "parallel": {"num_gpus": 2}})


def test_rank_local_variant_keeps_layerwise_refusals():
    with pytest.raises(ConfigError, match=r"compile.mode='regional' with offload.mode='layerwise'"):
        cfg({"allgather": False}, parallel={"num_gpus": 2}, compile={"mode": "regional"})
