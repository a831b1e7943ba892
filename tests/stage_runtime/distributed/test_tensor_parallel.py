"""Tensor-parallel and Ulysses × ring refusals at load (naming the numbers), and the rank layout of the
sequence-parallel subgroups. No spawned ranks: every check here runs before a process group is needed."""

from __future__ import annotations

import warnings

import dist_rank_checks as checks
import pytest
import torch

from stage_runtime.config import ParallelConfig
from stage_runtime.distributed.apply import apply_parallelism, check_heads
from stage_runtime.distributed.groups import single_rank_groups, sp_subgroup_ranks
from stage_runtime.distributed.tensor_parallel import check_tensor_parallel, enable_tensor_parallel
from stage_runtime.distributed.ulysses_joint import chunk_sizes
from stage_runtime.errors import ConfigError

torch.set_num_threads(1)


def quiet(**fields) -> ParallelConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # tp without ulysses warns
        return ParallelConfig(**fields)


@pytest.fixture(scope="module")
def dit(tiny_dit_path):
    return checks.load_adapter(tiny_dit_path)


def test_tp_not_dividing_the_heads_is_refused_naming_module_and_numbers(dit):
    weights = dit.denoiser.transformer_blocks[0].attn1.to_q.weight
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size=3 does not divide the attention heads of "
                                          r"DiTTransformer2DModel\.transformer_blocks\.0\.attn1 \(heads=4\)"):
        enable_tensor_parallel(dit.denoiser, None, 3)
    assert dit.denoiser.transformer_blocks[0].attn1.to_q.weight is weights   # nothing changed
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 × ulysses_degree=1 = 3 does not divide the "
                                          r"model's attention heads \(num_attention_heads=4\)"):
        apply_parallelism(dit, single_rank_groups(), quiet(tensor_parallel_size=3))


def test_tp_times_ulysses_must_divide_the_heads(dit):
    check_heads(4, quiet(tensor_parallel_size=2, ulysses_degree=2))
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 × ulysses_degree=4 = 8 does not divide .*=4\)"):
        check_heads(4, quiet(tensor_parallel_size=2, ulysses_degree=4))


def test_tp_not_dividing_the_mlp_hidden_size_is_refused():
    from diffusers.models.attention import FeedForward

    block = torch.nn.Module()
    block.ff = FeedForward(8, inner_dim=6, activation_fn="gelu-approximate")
    with pytest.raises(ConfigError, match="has no attention layers"):
        check_tensor_parallel(block, 4)
    from diffusers.models.attention_processor import Attention

    block.attn = Attention(8, heads=4, dim_head=2)
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size=4 does not divide the feed-forward hidden size "
                                          r"of Module\.ff \(inner_dim=6\)$"):
        check_tensor_parallel(block, 4)


def test_tp_needs_a_group_of_its_degree(dit):
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 needs a tensor-parallel group of 2 ranks"):
        enable_tensor_parallel(dit.denoiser, None, 2)


def test_flux_mlp_hidden_size_not_divisible_is_refused_naming_the_block(tiny_flux_path):
    flux = checks.load_adapter(tiny_flux_path)
    flux.denoiser.single_transformer_blocks[0].mlp_hidden_dim = 127
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size=2 does not divide the MLP hidden size of "
                                          r"FluxTransformer2DModel\.single_transformer_blocks\.0 "
                                          r"\(mlp_hidden_dim=127\)"):
        enable_tensor_parallel(flux.denoiser, None, 2)


@pytest.mark.parametrize(("ulysses", "ring", "extra", "expected"), [
    (2, 2, {}, ([[0, 1], [2, 3]], [[0, 2], [1, 3]])),
    (2, 2, {"tensor_parallel_size": 2}, ([[0, 2], [4, 6], [1, 3], [5, 7]], [[0, 4], [2, 6], [1, 5], [3, 7]])),
    (1, 2, {"cfg_parallel_size": 2}, ([[0], [1], [2], [3]], [[0, 1], [2, 3]])),
])
def test_ulysses_inside_ring_across_follow_the_layout(ulysses, ring, extra, expected):
    assert sp_subgroup_ranks(quiet(ulysses_degree=ulysses, ring_degree=ring, **extra)) == expected


def test_uneven_sequences_are_split_not_padded():
    assert chunk_sizes(37, 4) == [10, 9, 9, 9] and sum(chunk_sizes(333, 2)) == 333
