"""Process groups, single-rank path, model-level checks, topology rejections, and CollectiveError on a lost peer."""

from __future__ import annotations

import time
import warnings

import dist_rank_checks as checks
import pytest
import torch
import torch.distributed as dist

from stage_runtime.config import ParallelConfig
from stage_runtime.distributed import CollectiveError, destroy_distributed, init_distributed, single_rank_groups
from stage_runtime.distributed.apply import apply_parallelism
from stage_runtime.distributed.cfg_parallel import _local_rows, enable_cfg_parallel
from stage_runtime.distributed.groups import _replicas
from stage_runtime.distributed.ulysses import check_ulysses_heads, enable_ulysses
from stage_runtime.errors import ConfigError, WorkerFatalError

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def sd(tiny_sd_path):
    return checks.load_adapter(tiny_sd_path)


# -- world 1 ---------------------------------------------------------------------------------------------
def test_single_rank_needs_no_distributed_init(sd):
    groups = init_distributed(ParallelConfig(), 0, "tcp://127.0.0.1:1", torch.device("cpu"), 1.0)
    assert groups == single_rank_groups()
    assert (groups.world_size, groups.is_replica_leader, groups.replica_ranks) == (1, True, [0])
    assert (groups.dp_rank, groups.dp_size) == (0, 1)
    assert groups.cfg_group is groups.sp_group is groups.replica_group is None
    forward = sd.denoiser.forward
    apply_parallelism(sd, groups, ParallelConfig())
    enable_cfg_parallel(sd.denoiser, None)
    enable_ulysses(sd.denoiser, None, 1)
    assert sd.denoiser.forward == forward
    destroy_distributed()
    destroy_distributed()  # idempotent, never initialised
    assert not dist.is_initialized()


def test_replicas_follow_the_layout():
    parallel = ParallelConfig(cfg_parallel_size=2, num_gpus=4)
    assert _replicas(parallel) == [[0, 1], [2, 3]]
    assert _replicas(ParallelConfig(ulysses_degree=2, cfg_parallel_size=2, data_parallel_size=2)) == [
        [0, 1, 2, 3], [4, 5, 6, 7]]


# -- model-level and unsupported-topology checks ---------------------------------------------------------
def test_check_ulysses_heads_names_both_numbers():
    check_ulysses_heads(4, 1)
    check_ulysses_heads(4, 2)
    check_ulysses_heads(4, 4)
    with pytest.raises(ConfigError, match=r"ulysses_degree=3 .*num_attention_heads=4"):
        check_ulysses_heads(4, 3)


def test_apply_rejects_ulysses_degree_not_dividing_heads(sd):
    with pytest.raises(ConfigError, match=r"ulysses_degree=8 .*num_attention_heads=4"):
        apply_parallelism(sd, single_rank_groups(), ParallelConfig(ulysses_degree=8))


@pytest.mark.parametrize(("field", "kind"), [("cfg_parallel_size", "cfg"), ("ulysses_degree", "ulysses")])
def test_apply_refuses_parallel_kinds_the_family_does_not_list(sd, monkeypatch, field, kind):
    monkeypatch.setattr(type(sd), "parallel_kinds", frozenset({"cfg", "ulysses"}) - {kind})
    monkeypatch.setattr(type(sd), "parallel_refusal", lambda self, k: f"no {k} here")
    with pytest.raises(ConfigError, match=rf"^{field}=2 is not supported by StableDiffusionPipeline "
                                          rf"\(it runs: [a-z]+\): no {kind} here$"):
        apply_parallelism(sd, single_rank_groups(), ParallelConfig(**{field: 2}))


@pytest.mark.parametrize(("field", "kind"), [("tensor_parallel_size", "tp"), ("ring_degree", "ring")])
def test_apply_refuses_tp_and_ring_for_a_family_that_does_not_list_them(sd, field, kind):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tp without ulysses warns; not the point here
        parallel = ParallelConfig(**{field: 2})
    assert kind not in type(sd).parallel_kinds
    expected = rf"^{field}=2 is not supported by StableDiffusionPipeline \(it runs: cfg, ulysses\)$"
    with pytest.raises(ConfigError, match=expected):
        apply_parallelism(sd, single_rank_groups(), parallel)


def test_apply_refuses_pipeline_parallel_with_the_reason(sd):
    with pytest.raises(ConfigError, match=r"^pipeline_parallel_size=2 is not supported \(StableDiffusionPipeline\): "
                                          r"this runtime does not run pipeline parallelism \(PipeFusion"):
        apply_parallelism(sd, single_rank_groups(), ParallelConfig(pipeline_parallel_size=2))


def test_ulysses_rejects_attention_features_it_does_not_implement(tiny_dit_path):
    dit = checks.load_adapter(tiny_dit_path)
    dit.denoiser.transformer_blocks[1].attn1.residual_connection = True
    with pytest.raises(ConfigError, match=r"transformer_blocks\.1\.attn1 uses residual_connection"):
        enable_ulysses(dit.denoiser, None, 2)
    dit.denoiser.transformer_blocks[1].attn1.residual_connection = False
    with pytest.raises(ConfigError, match="ulysses_degree=2 needs a sequence-parallel group of 2 ranks"):
        enable_ulysses(dit.denoiser, None, 2)
    with pytest.raises(ConfigError, match="no Transformer2DModel"):
        enable_ulysses(dit.pipe.vae, None, 2)


def test_cfg_rows_are_contiguous_and_padded_with_the_last_row():
    rows = torch.arange(3)
    assert _local_rows(rows, 3, 2, 0).tolist() == [0, 1]
    assert _local_rows(rows, 3, 2, 1).tolist() == [2, 2]
    assert _local_rows(torch.arange(1), 1, 1, 1).tolist() == [0]
    assert _local_rows(torch.tensor(5), 3, 2, 1).item() == 5          # 0-d timestep kept
    assert _local_rows(torch.arange(7), 3, 2, 1).tolist() == list(range(7))  # not per-row: kept


# -- a lost peer is a CollectiveError, not a hang ---------------------------------------------------------
@pytest.mark.parametrize("peer", ["stall", "exit"])
def test_lost_peer_raises_collective_error_within_timeout(two_rank_runs, peer):
    """Rank 1 stalls past timeout_s (gloo times out) or its process exits (gloo sees the closed
    connection) instead of joining rank 0's all_gather: rank 0 gets a CollectiveError naming op and group."""
    by_run, _ = two_rank_runs
    result = by_run[f"peer-{peer}"]
    assert result[1] == {"left": peer, "exit": peer == "exit"}
    error, seconds = result[0]["error"], result[0]["seconds"]
    assert error is not None and error.startswith("all_gather on group ranks [0, 1] failed: "), error
    assert seconds < checks.PEER_TIMEOUT_S + 10, (seconds, error)          # the timeout fired: no hang
    if peer == "stall":
        assert "Timed out" in error
    assert issubclass(CollectiveError, WorkerFatalError) and issubclass(CollectiveError, RuntimeError)


def test_a_peer_that_never_joins_is_a_collective_error_within_timeout():
    start = time.monotonic()
    with pytest.raises(CollectiveError, match=r"^init_process_group\(gloo, tcp://127\.0\.0\.1:\d+\) .*failed: "):
        init_distributed(ParallelConfig(cfg_parallel_size=2), 0, f"tcp://127.0.0.1:{checks.free_ports(1)[0]}",
                         torch.device("cpu"), 1.0)
    assert time.monotonic() - start < 1.0 + 10                                # the 1 s timeout fired: no hang
    assert not dist.is_initialized()


def test_a_backend_other_than_gloo_or_nccl_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"backend='mpi': expected 'gloo', 'nccl' or None"):
        init_distributed(ParallelConfig(cfg_parallel_size=2), 0, "tcp://127.0.0.1:1", torch.device("cpu"), 1.0,
                         backend="mpi")
    assert not dist.is_initialized()


def test_a_ring_message_over_gloo_travels_through_host_memory_whatever_the_tensors_device():
    """gloo's send/recv read host memory only: ranks sharing one GPU over gloo (bench/gpu_check.py) stage the ring's
    blocks on the host. (A meta tensor stands in for a device tensor; the decision reads only the group.)"""
    from stage_runtime.distributed.ring import staging_device

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{checks.free_ports(1)[0]}", rank=0, world_size=1)
    try:
        assert staging_device(torch.device("meta"), dist.group.WORLD) == torch.device("cpu")
        assert staging_device(torch.device("cpu"), None) == torch.device("cpu")      # None: the default group
    finally:
        destroy_distributed()
    assert not dist.is_initialized()
