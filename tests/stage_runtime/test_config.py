"""Tests for stage_runtime.config: validation, topology arithmetic, rank layout, loading, merging."""

import math
import re
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from pydantic import ValidationError

from stage_runtime.config import (
    ConfigError,
    ParallelConfig,
    RankCoords,
    StageConfig,
    load_config,
    load_config_file,
    merge_overrides,
)
from stage_runtime.errors import DiffStageError

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = {"path": "/models/tiny-sd"}


def cfg(**sections) -> StageConfig:
    return load_config({"model": MODEL, **sections})


def test_defaults():
    c = cfg()
    p = c.parallel
    assert (p.world_size, p.dp_size, p.sp_size, p.model_parallel_size) == (1, 1, 1, 1)
    assert c.executor is None and c.resolved_executor == "uni"
    assert c.scheduler.execution_mode == "request"
    assert (c.scheduler.max_num_seqs, c.scheduler.max_waiting) == (1, 256)
    assert c.model.dtype == "float32" and c.device == "auto" and c.warmup is True
    assert p.describe() == "world_size=1 (tp=1 sp=1[ulysses=1 ring=1] pp=1 cfg=1 dp=1)"


@pytest.mark.parametrize(
    "parallel, world, sp, dp, executor",
    [
        ({"num_gpus": 4, "cfg_parallel_size": 2}, 4, 1, 2, "mp"),
        ({"num_gpus": 8, "ulysses_degree": 2, "ring_degree": 2}, 8, 4, 2, "mp"),
        ({"num_gpus": 2}, 2, 1, 2, "mp"),
        ({"data_parallel_size": 3, "tensor_parallel_size": 2, "ulysses_degree": 2}, 12, 2, 3, "mp"),
        ({"num_gpus": 4, "cfg_parallel_size": 2, "data_parallel_size": 2}, 4, 1, 2, "mp"),
        ({"ulysses_degree": 2, "sequence_parallel_size": 2}, 2, 2, 1, "mp"),
        ({"pipeline_parallel_size": 2, "num_gpus": 4}, 4, 1, 2, "mp"),  # PP accepted by the arithmetic
        ({"num_gpus": 1}, 1, 1, 1, "uni"),
    ],
)
def test_world_and_dp_inference(parallel, world, sp, dp, executor):
    c = cfg(parallel=parallel)
    assert (c.parallel.world_size, c.parallel.sp_size, c.parallel.dp_size) == (world, sp, dp)
    assert c.resolved_executor == executor


def test_dp_without_num_gpus_multiplies_world():
    with pytest.warns(UserWarning):  # tp=2 without ulysses
        c = cfg(parallel={"data_parallel_size": 3, "tensor_parallel_size": 2})
    assert (c.parallel.world_size, c.parallel.dp_size, c.parallel.model_parallel_size) == (6, 3, 2)


def test_describe_names_every_dimension():
    c = cfg(parallel={"num_gpus": 4, "cfg_parallel_size": 2})
    assert c.parallel.describe() == "world_size=4 (tp=1 sp=1[ulysses=1 ring=1] pp=1 cfg=2 dp=2)"


@pytest.mark.parametrize(
    "data, parts",
    [
        ({"parallel": {"num_gpus": 3, "cfg_parallel_size": 2}},
         ["num_gpus=3 is not divisible by", "tensor_parallel_size(1)", "sequence_parallel_size(1)",
          "pipeline_parallel_size(1)", "cfg_parallel_size(2) = 2"]),
        ({"parallel": {"num_gpus": 4, "cfg_parallel_size": 2, "data_parallel_size": 3}},
         ["data_parallel_size=3 does not match", "num_gpus=4", "= 2"]),
        ({"parallel": {"sequence_parallel_size": 3, "ulysses_degree": 2, "ring_degree": 2}},
         ["sequence_parallel_size=3 does not match", "ulysses_degree(2)", "ring_degree(2)", "= 4"]),
        ({"parallel": {"cfg_parallel_size": 0}},
         ["parallel.cfg_parallel_size=0", "greater than or equal to 1"]),
        ({"parallel": {"tensor_parallel_size": -2}},
         ["parallel.tensor_parallel_size=-2", "greater than or equal to 1"]),
        ({"parallel": {"ulysses_degree": 0}}, ["parallel.ulysses_degree=0"]),
        ({"parallel": {"ring_degree": -1}}, ["parallel.ring_degree=-1"]),
        ({"parallel": {"num_gpus": 0}}, ["parallel.num_gpus=0"]),
        ({"parallel": {"data_parallel_size": 0}}, ["parallel.data_parallel_size=0"]),
        ({"parallel": {"pipeline_parallel_size": 0}}, ["parallel.pipeline_parallel_size=0"]),
        ({"parallel": {"cfg_parallel_size": 3}},
         ["parallel.cfg_parallel_size=3", "less than or equal to 2"]),
        ({"bogus": 1}, ["unknown field bogus"]),
        ({"parallel": {"foo": 1}}, ["unknown field parallel.foo"]),
        ({"scheduler": {"request_batch_max_wait_ms": -1}},
         ["scheduler.request_batch_max_wait_ms=-1", "greater than or equal to 0"]),
        ({"scheduler": {"request_batch_max_wait_ms": math.nan}},
         ["scheduler.request_batch_max_wait_ms=nan", "finite"]),
        ({"scheduler": {"request_batch_max_wait_ms": math.inf}},
         ["scheduler.request_batch_max_wait_ms=inf", "finite"]),
        ({"scheduler": {"max_num_seqs": 0}}, ["scheduler.max_num_seqs=0"]),
        ({"scheduler": {"max_num_seqs": 1025}}, ["scheduler.max_num_seqs=1025"]),
        ({"scheduler": {"max_waiting": 0}}, ["scheduler.max_waiting=0"]),
        ({"scheduler": {"execution_mode": "request", "streaming_output": True}},
         ["streaming_output=True", "execution_mode='request'"]),
        ({"scheduler": {"execution_mode": "batch"}}, ["scheduler.execution_mode='batch'"]),
        ({"executor": "uni", "parallel": {"num_gpus": 2}}, ["executor='uni'", "world_size=2"]),
        ({"executor": "not a path"}, ["executor='not a path'", "package.module:ClassName"]),
        ({"worker_start_method": "fork"}, ["worker_start_method='fork'", "'forkserver' or 'spawn'"]),
        ({"model": {**MODEL, "adapter": "my_pkg.adapters.Thing"}},
         ["model.adapter='my_pkg.adapters.Thing'", "package.module:ClassName"]),
        ({"model": {**MODEL, "adapter": "pkg.mod:Cls:extra"}}, ["model.adapter="]),
        ({"model": {**MODEL, "dtype": "int8"}}, ["model.dtype='int8'", "bfloat16"]),
        ({"model": {}}, ["model.path", "required"]),
        ({"model": {"path": ""}}, ["model.path=''"]),
        ({"device": "tpu"}, ["device='tpu'"]),
    ],
)
def test_rejections_name_fields_and_numbers(data, parts):
    data = {"model": MODEL, **data}
    with pytest.raises(ConfigError) as info:
        load_config(data)
    msg = str(info.value)
    assert "\n" not in msg  # one line: it becomes the termination message
    assert "Value error," not in msg
    for part in parts:
        assert part in msg, (part, msg)


def test_missing_model_and_several_problems_reported_together():
    with pytest.raises(ConfigError) as info:
        load_config({"parallel": {"cfg_parallel_size": 0, "foo": 1}})
    msg = str(info.value)
    assert "model: Field required" in msg
    assert "parallel.cfg_parallel_size=0" in msg and "unknown field parallel.foo" in msg
    assert msg.count("; ") == 2


def test_config_error_is_value_error_and_diffstage_error():
    with pytest.raises(ConfigError) as info:
        load_config({"model": MODEL, "parallel": {"cfg_parallel_size": 3}})
    assert isinstance(info.value, ValueError) and isinstance(info.value, DiffStageError)


@pytest.mark.parametrize("bad", [None, [], "model: x", 3])
def test_load_config_rejects_non_mapping(bad):
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


@pytest.mark.parametrize(
    "scheduler, mode",
    [
        ({"streaming_output": True}, "step"),
        ({"streaming_output": True, "execution_mode": "step"}, "step"),
        ({"execution_mode": "step"}, "step"),
        ({}, "request"),
    ],
)
def test_streaming_forces_step_mode(scheduler, mode):
    assert cfg(scheduler=scheduler).scheduler.execution_mode == mode


@pytest.mark.parametrize("scheduler, field", [
    ({"scheduling_policy": "lifo"}, "scheduling_policy"),
    ({"max_preemptions": -1}, "max_preemptions"),
    ({"aging_ticks": -5}, "aging_ticks"),
    ({"default_timeout_s": 0}, "default_timeout_s"),
    ({"preempted_offload_max_bytes": -1}, "preempted_offload_max_bytes"),
])
def test_bad_scheduling_fields_name_the_field(scheduler, field):
    with pytest.raises(ConfigError, match=f"scheduler.{field}"):
        cfg(scheduler=scheduler)


@pytest.mark.parametrize("executor", ["uni", "mp", "my_pkg.executors:RayExecutor", "mod:Cls"])
def test_explicit_executor_kept(executor):
    assert cfg(executor=executor).resolved_executor == executor


def test_valid_adapter_and_model_fields():
    c = cfg(model={**MODEL, "adapter": "my_pkg.adapters:MyPipeline", "dtype": "bfloat16", "served_name": "sd"})
    assert (c.model.adapter, c.model.dtype, c.model.served_name) == ("my_pkg.adapters:MyPipeline", "bfloat16", "sd")


@pytest.mark.parametrize(
    "data",
    [
        {},
        {"parallel": {"num_gpus": 4, "cfg_parallel_size": 2}, "executor": "mp"},
        {"scheduler": {"streaming_output": True, "max_num_seqs": 4, "request_batch_max_wait_ms": 2.5}},
        {"parallel": {"ulysses_degree": 2, "ring_degree": 2, "data_parallel_size": 2}, "device": "cpu"},
    ],
)
def test_model_dump_round_trips(data):
    c = cfg(**data)
    assert load_config(c.model_dump()) == c
    assert load_config(c.model_dump(exclude_unset=True)) == c


def test_configs_are_frozen():
    c = cfg()
    with pytest.raises(ValidationError):
        c.device = "cpu"
    with pytest.raises(ValidationError):
        c.parallel.num_gpus = 2


def test_rank_layout_tp_fastest_then_cfg():
    with pytest.warns(UserWarning):
        p = ParallelConfig(tensor_parallel_size=2, cfg_parallel_size=2)
    layout = p.rank_layout()
    assert p.world_size == 4 and [rc.rank for rc in layout] == [0, 1, 2, 3]
    assert layout[1] == RankCoords(rank=1, tp=1, sp=0, pp=0, cfg=0, dp=0)
    assert layout[2] == RankCoords(rank=2, tp=0, sp=0, pp=0, cfg=1, dp=0)
    assert p.group_ranks("cfg") == [[0, 2], [1, 3]]
    assert p.group_ranks("tp") == [[0, 1], [2, 3]]
    assert p.group_ranks("dp") == [[0], [1], [2], [3]]


def test_rank_layout_ulysses_and_dp():
    p = ParallelConfig(ulysses_degree=2, num_gpus=4)
    assert (p.sp_size, p.dp_size) == (2, 2)
    assert p.rank_layout()[1] == RankCoords(1, tp=0, sp=1, pp=0, cfg=0, dp=0)
    assert p.rank_layout()[2] == RankCoords(2, tp=0, sp=0, pp=0, cfg=0, dp=1)
    assert p.group_ranks("sp") == [[0, 1], [2, 3]]
    assert p.group_ranks("dp") == [[0, 2], [1, 3]]
    assert p.group_ranks("tp") == [[0], [1], [2], [3]]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tensor_parallel_size": 2, "ulysses_degree": 2, "cfg_parallel_size": 2, "num_gpus": 16},
        {"ulysses_degree": 2, "ring_degree": 2, "pipeline_parallel_size": 2, "data_parallel_size": 2},
        {"tensor_parallel_size": 2, "ulysses_degree": 2, "ring_degree": 2, "cfg_parallel_size": 2},
    ],
)
def test_rank_formula_and_groups_partition_world(kwargs):
    p = ParallelConfig(**kwargs)
    s = p.sizes()
    for rc in p.rank_layout():
        assert rc.rank == rc.tp + s["tp"] * (rc.sp + s["sp"] * (rc.pp + s["pp"] * (rc.cfg + s["cfg"] * rc.dp)))
    for dim in ("tp", "sp", "pp", "cfg", "dp"):
        groups = p.group_ranks(dim)
        assert sorted(r for g in groups for r in g) == list(range(p.world_size))
        assert all(len(g) == s[dim] for g in groups) and len(groups) == p.world_size // s[dim]


def test_group_ranks_rejects_unknown_dim():
    with pytest.raises(ValueError, match="unknown parallel dimension"):
        ParallelConfig().group_ranks("ep")


@pytest.mark.parametrize(
    "kwargs, warns",
    [
        ({"tensor_parallel_size": 2}, True),
        ({"tensor_parallel_size": 4, "ring_degree": 2}, True),
        ({"tensor_parallel_size": 2, "ulysses_degree": 2}, False),
        ({"tensor_parallel_size": 1}, False),
        ({"ulysses_degree": 2}, False),
    ],
)
def test_tp_without_ulysses_warns(kwargs, warns):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ParallelConfig(**kwargs)
    hits = [w for w in caught if "ulysses_degree=1" in str(w.message)]
    assert bool(hits) is warns
    if warns:
        assert f"tensor_parallel_size={kwargs['tensor_parallel_size']}" in str(hits[0].message)


def test_load_config_file(tmp_path):
    path = tmp_path / "stage.yaml"
    path.write_text(
        "model:\n  path: /models/tiny-dit\n  dtype: bfloat16\n"
        "parallel:\n  num_gpus: 4\n  cfg_parallel_size: 2\n"
        "scheduler:\n  streaming_output: true\n  request_batch_max_wait_ms: .nan\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config_file(path)
    assert str(path) in str(info.value) and "scheduler.request_batch_max_wait_ms=nan" in str(info.value)

    path.write_text(path.read_text().replace(".nan", "5"))
    c = load_config_file(str(path))
    assert (c.model.path, c.model.dtype) == ("/models/tiny-dit", "bfloat16")
    assert (c.parallel.dp_size, c.scheduler.execution_mode, c.resolved_executor) == (2, "step", "mp")


def test_load_config_file_missing(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config_file(path)


@pytest.mark.parametrize(
    "text, part", [("model: [unclosed\n", "not valid YAML"), ("", "model"), ("- a\n", "mapping")]
)
def test_load_config_file_bad_yaml(tmp_path, text, part):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config_file(path)
    assert str(path) in str(info.value) and part in str(info.value)
    assert "\n" not in str(info.value)


def test_merge_overrides_deep_merges_and_ignores_none():
    base = {"model": {"path": "/a", "dtype": "float16"}, "parallel": {"num_gpus": 4, "cfg_parallel_size": 2},
            "executor": "mp"}
    overrides = {"model": {"path": None, "served_name": "sd"}, "parallel": {"num_gpus": 2, "cfg_parallel_size": None},
                 "executor": None, "scheduler": {"max_num_seqs": 4, "max_waiting": None}, "device": "cpu"}
    merged = merge_overrides(base, overrides)
    assert merged == {
        "model": {"path": "/a", "dtype": "float16", "served_name": "sd"},
        "parallel": {"num_gpus": 2, "cfg_parallel_size": 2},
        "executor": "mp",
        "scheduler": {"max_num_seqs": 4},
        "device": "cpu",
    }
    assert base["parallel"]["num_gpus"] == 4  # base not mutated
    assert load_config(merged).parallel.dp_size == 1


@pytest.mark.parametrize(
    "base, overrides, expected",
    [
        ({}, {}, {}),
        ({"a": 1}, {"a": None}, {"a": 1}),
        ({"a": 1}, {"a": {"b": 2}}, {"a": {"b": 2}}),
        ({"a": {"b": 1}}, {"a": 5}, {"a": 5}),
        ({"a": {"b": {"c": 1, "d": 2}}}, {"a": {"b": {"c": 9}}}, {"a": {"b": {"c": 9, "d": 2}}}),
        ({"a": [1, 2]}, {"a": [3]}, {"a": [3]}),
        ({"a": False}, {"a": False}, {"a": False}),
    ],
)
def test_merge_overrides_cases(base, overrides, expected):
    assert merge_overrides(base, overrides) == expected


def test_config_module_does_not_import_torch():
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    code = ("import sys, stage_runtime.config; "
            "bad = [m for m in ('torch', 'diffusers') if m in sys.modules]; assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_the_cache_section_defaults_bounds_and_flags():
    from stage_runtime.cli import build_parser, config_from_args

    cache = load_config({"model": {"path": "/m"}}).cache
    assert (cache.mode, cache.threshold, cache.warmup_steps, cache.final_steps) == ("none", 0.1, 1, 1)
    assert (cache.result_max_bytes, cache.prompt_max_bytes) == (0, 0)
    for bad, named in (({"mode": "teacache"}, "cache.mode='teacache'"), ({"threshold": 11}, "cache.threshold=11"),
                       ({"warmup_steps": 0}, "cache.warmup_steps=0"), ({"result_max_bytes": -1}, "result_max_bytes")):
        with pytest.raises(ConfigError, match=named.replace(".", r"\.").replace("(", r"\(")):
            load_config({"model": {"path": "/m"}, "cache": bad})
    args = build_parser().parse_args(["validate", "--model", "/m", "--cache-mode", "block", "--cache-threshold", "0.2",
                                      "--cache-warmup-steps", "3", "--result-cache-bytes", "1000",
                                      "--prompt-cache-bytes", "2000"])
    cache = config_from_args(args).cache
    assert (cache.mode, cache.threshold, cache.warmup_steps, cache.result_max_bytes, cache.prompt_max_bytes) == (
        "block", 0.2, 3, 1000, 2000)


def test_loras_are_named_distinct_and_bounded_by_max_loras():
    from stage_runtime.config import load_config as load

    config = load({"model": {"path": "/m"}, "loras": [{"name": "pixel-art", "path": "/a"},
                                                      {"name": "ink", "path": "/b", "pinned": False}]})
    assert [(s.name, s.pinned) for s in config.loras] == [("pixel-art", True), ("ink", False)]
    assert config.max_loras == 8
    for loras, extra, message in (
            ([{"name": "a", "path": "/a"}, {"name": "a", "path": "/b"}], {}, "names must be distinct"),
            ([{"name": "a", "path": "/a"}, {"name": "b", "path": "/b"}], {"max_loras": 1},
             "2 startup adapters but max_loras=1"),
            ([{"name": "../a", "path": "/a"}], {}, "loras.0.name='../a'")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            load({"model": {"path": "/m"}, "loras": loras, **extra})
