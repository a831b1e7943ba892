"""Wan's sequence parallelism, the parts that need no second rank: the split rule (a mesh's rank and size are all
it reads), the head count, and the refusals at load, which install nothing (the 2- and 4-rank equality runs are
in test_families_parallel.py, test_ring_tp.py and test_world4_hybrid.py)."""

from __future__ import annotations

import warnings

import dist_rank_checks as checks
import pytest
import torch

from stage_runtime.config import ParallelConfig
from stage_runtime.distributed.apply import apply_parallelism
from stage_runtime.distributed.groups import single_rank_groups
from stage_runtime.models.families.wan_ulysses import WanUlyssesAttnProcessor, enable_wan_sequence_parallel, split_video
from stage_runtime.distributed.usp import SequenceMesh
from stage_runtime.errors import ConfigError

torch.set_num_threads(1)


def mesh(rank: int, size: int = 2) -> SequenceMesh:
    return SequenceMesh(sp_group=None, sp_size=size, sp_rank=rank)


def block_call(tokens: int, per_token: bool):
    """A Wan block's positional call: video (2, S, 8), text (2, 5, 8), modulation (2, [S,] 6, 8), rotary tables."""
    temb = torch.randn(2, tokens, 6, 8) if per_token else torch.randn(2, 6, 8)
    rotary = (torch.arange(tokens, dtype=torch.float64).view(1, tokens, 1, 1).expand(1, tokens, 1, 4),) * 2
    return torch.randn(2, tokens, 8), torch.randn(2, 5, 8), temb, rotary


@pytest.mark.parametrize("per_token", [False, True], ids=["per-row-modulation", "ti2v-per-token-modulation"])
def test_split_rule_gives_each_rank_its_tokens_rotary_rows_and_modulation_for_every_block(per_token):
    video, text, temb, rotary = block_call(5, per_token)
    for rank, rows in ((0, [0, 1, 2]), (1, [3, 4])):
        shard = split_video(mesh(rank), (video, text, temb, rotary), {})
        args = shard.args
        assert shard.kwargs == {} and shard.image == [3, 2] and args[1] is text
        torch.testing.assert_close(args[0], video[:, rows])
        assert args[3][0][0, :, 0, 0].tolist() == rows                    # my rotary rows, both tables
        torch.testing.assert_close(args[2], temb[:, rows] if per_token else temb)
        assert sorted(shard.later) == ([2, 3] if per_token else [3])      # later blocks: by position
        assert shard.later[3] is args[3]
    keywords = split_video(mesh(1), (), {"hidden_states": video, "encoder_hidden_states": text, "temb": temb,
                                         "rotary_emb": rotary})
    assert keywords.args == () and sorted(keywords.later) == (["rotary_emb", "temb"] if per_token else ["rotary_emb"])
    torch.testing.assert_close(keywords.kwargs["hidden_states"], video[:, 3:])


def test_fewer_video_tokens_than_ranks_run_unsharded():
    assert split_video(mesh(0, 4), block_call(3, False), {}) is None
    assert split_video(mesh(0, 2), block_call(2, False), {}) is not None


@pytest.fixture(scope="module")
def wan22(tiny_wan22_path):
    return checks.load_adapter(tiny_wan22_path)


def sharded_attentions(adapter) -> int:
    return sum(isinstance(getattr(m, "processor", None), WanUlyssesAttnProcessor) for m in adapter.denoiser.modules())


def test_head_count_is_the_experts_attention_heads(wan22):
    assert wan22.num_attention_heads() == wan22.info().num_attention_heads == 4


def test_tensor_parallel_is_refused_naming_the_family_the_degree_and_why(wan22):
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size=2 is not supported by WanPipeline \(it runs: cfg, "
                                          r"ring, ulysses\): .*WanAttention RMS-normalises q and k across all heads"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # tp without ulysses warns; not the point here
            apply_parallelism(wan22, single_rank_groups(), ParallelConfig(tensor_parallel_size=2))


def test_refusals_at_load_name_the_reason_and_install_nothing(wan22):
    with pytest.raises(ConfigError, match=r"ulysses_degree=3 does not divide .*num_attention_heads=4"):
        apply_parallelism(wan22, single_rank_groups(), ParallelConfig(ulysses_degree=3))
    with pytest.raises(ConfigError, match="ulysses_degree=2 needs a sequence-parallel group of 2 ranks"):
        enable_wan_sequence_parallel(wan22.denoiser, 2, lambda: SequenceMesh.ulysses(None, 2))
    attn = wan22.denoiser.transformer_2.blocks[1].attn1
    original = attn.processor
    attn.fuse_projections()
    try:
        with pytest.raises(ConfigError, match=r"transformer_2\.blocks\.1\.attn1 has fused q/k/v projections"):
            enable_wan_sequence_parallel(wan22.denoiser, 2, lambda: SequenceMesh.ulysses(None, 2))
    finally:
        attn.unfuse_projections()
    attn.set_processor(object())
    try:
        with pytest.raises(ConfigError, match=r"transformer_2\.blocks\.1\.attn1 uses object; only the self-attention "
                                              r"of diffusers' WanAttnProcessor is sharded"):
            enable_wan_sequence_parallel(wan22.denoiser, 2, lambda: SequenceMesh.ulysses(None, 2))
    finally:
        attn.set_processor(original)
    assert sharded_attentions(wan22) == 0 and not hasattr(wan22.denoiser, "_diffstage_sequence_parallel")
