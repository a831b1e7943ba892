"""HunyuanVideo-1.5's sequence parallelism, the parts that need no second rank: the split rule (a mesh's rank and
size are all it reads), the sharded attention on a one-rank mesh against diffusers' processor (both streams, the
padded context tokens included), the head count, and the refusals at load, which install nothing (the 2- and
4-rank equality runs are in test_families_parallel.py, test_ring_tp.py and test_world4_hybrid.py)."""

from __future__ import annotations

import warnings

import dist_rank_checks as checks
import pytest
import torch

from stage_runtime.config import ParallelConfig
from stage_runtime.distributed.apply import apply_parallelism
from stage_runtime.distributed.groups import single_rank_groups
from stage_runtime.distributed.sequence_shard import ShardState
from stage_runtime.models.families.hunyuan_video15 import (
    HunyuanVideo15UlyssesAttnProcessor,
    enable_hunyuan_video15_sequence_parallel,
    split_hunyuan,
)
from stage_runtime.distributed.usp import SequenceMesh
from stage_runtime.errors import ConfigError

torch.set_num_threads(1)


def mesh(rank: int, size: int = 2) -> SequenceMesh:
    return SequenceMesh(sp_group=None, sp_size=size, sp_rank=rank)


def block_call(video: int, context: int, channels: int = 8):
    """A block's positional call: video (2, S, C), context (2, T, C), per-row modulation (2, C), the context mask
    (row 0: all valid; row 1: the last two padded), the rotary tables (S, 4) whose rows are their index."""
    mask = torch.ones(2, context, dtype=torch.bool)
    mask[1, -2:] = False
    rotary = (torch.arange(video, dtype=torch.float32)[:, None].expand(video, 4),) * 2
    return torch.randn(2, video, channels), torch.randn(2, context, channels), torch.randn(2, channels), mask, rotary


def test_split_rule_cuts_both_streams_the_mask_and_the_rotary_rows_unevenly():
    video, context, temb, mask, rotary = block_call(5, 5)
    for rank, rows in ((0, [0, 1, 2]), (1, [3, 4])):
        shard = split_hunyuan(mesh(rank), (video, context, temb, mask, rotary), {})
        args = shard.args
        assert shard.kwargs == {} and shard.image == [3, 2] and shard.text == [3, 2] and args[2] is temb
        torch.testing.assert_close(args[0], video[:, rows])
        torch.testing.assert_close(args[1], context[:, rows])
        assert torch.equal(args[3], mask[:, rows])
        assert args[4][0][:, 0].tolist() == args[4][1][:, 0].tolist() == rows              # my rotary rows
        assert sorted(shard.later) == [3, 4] and shard.later[3] is args[3] and shard.later[4] is args[4]
        # keys in sp-rank order: [rank 0's video ‖ its context ‖ rank 1's video ‖ its context]
        assert shard.key_mask[1].tolist() == [True] * 3 + [True] * 3 + [True] * 2 + [False] * 2
        assert shard.key_mask[0].all()
    keywords = split_hunyuan(mesh(1), (), {"hidden_states": video, "encoder_hidden_states": context, "temb": temb,
                                           "attention_mask": mask, "freqs_cis": rotary})
    assert keywords.args == () and sorted(keywords.later) == ["attention_mask", "freqs_cis"]
    torch.testing.assert_close(keywords.kwargs["encoder_hidden_states"], context[:, 3:])


def test_a_stream_shorter_than_the_ranks_runs_unsharded_and_a_call_without_its_mask_is_refused():
    assert split_hunyuan(mesh(0, 4), block_call(3, 8), {}) is None
    assert split_hunyuan(mesh(0, 4), block_call(8, 3), {}) is None
    assert split_hunyuan(mesh(0, 4), block_call(4, 4), {}) is not None
    video, context, temb, _mask, rotary = block_call(4, 4)
    with pytest.raises(RuntimeError, match="without its context mask"):
        split_hunyuan(mesh(0), (video, context, temb, None, rotary), {})


@pytest.fixture(scope="module")
def hunyuan(tiny_hunyuan_video15_path):
    return checks.load_adapter(tiny_hunyuan_video15_path)


def test_the_sharded_attention_equals_diffusers_on_both_streams_padded_context_tokens_included(hunyuan):
    """On a one-rank mesh the processor runs its whole path (projections, norms, rotary rows, the key mask, the
    zeroed padded queries, the output projections) with plain SDPA for the mesh: it must give diffusers' result for
    every token, the context tokens that attend to nothing (their query mask) too."""
    transformer = hunyuan.denoiser
    attn = transformer.transformer_blocks[0].attn
    inner = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    gen = torch.Generator().manual_seed(0)
    video, context = torch.randn(2, 12, inner, generator=gen), torch.randn(2, 9, inner, generator=gen)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, 6:], mask[1, 3:] = False, False
    rotary = transformer.rope(torch.zeros(1, 1, 3, 2, 2))                       # 3 x 2 x 2 = 12 video tokens
    state = ShardState()
    state.shard = split_hunyuan(mesh(0, 1), (video, context, None, mask, rotary), {})
    processor = HunyuanVideo15UlyssesAttnProcessor(mesh(0, 1), state, attn.processor)
    with torch.inference_mode():
        want = attn.processor(attn, video, context, mask, rotary)
        got = processor(attn, video, context, mask, rotary)
        # diffusers: a padded context token attends to nothing (zeros), so its output is to_add_out's bias alone
        torch.testing.assert_close(want[1][0, 6:], attn.to_add_out.bias.expand(3, -1), rtol=0, atol=1e-6)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        state.shard = None                                     # unsharded calls: the model's own processor
        torch.testing.assert_close(processor(attn, video, context, mask, rotary)[0], want[0], rtol=0, atol=0)


def sharded_attentions(adapter) -> int:
    return sum(isinstance(getattr(m, "processor", None), HunyuanVideo15UlyssesAttnProcessor)
               for m in adapter.denoiser.modules())


def test_head_count_and_the_families_parallel_kinds(hunyuan):
    assert hunyuan.num_attention_heads() == hunyuan.info().num_attention_heads == 2
    assert hunyuan.info().parallel_kinds == ("cfg", "ring", "ulysses")


def test_tensor_parallel_is_refused_naming_the_family_the_degree_and_why(hunyuan):
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size=2 is not supported by HunyuanVideo15Pipeline \(it "
                                          r"runs: cfg, ring, ulysses\): .*HunyuanVideo15AttnProcessor2_0"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # tp without ulysses warns; not the point here
            apply_parallelism(hunyuan, single_rank_groups(), ParallelConfig(tensor_parallel_size=2))


def test_refusals_at_load_name_the_reason_and_install_nothing(hunyuan):
    with pytest.raises(ConfigError, match=r"ulysses_degree=4 does not divide .*num_attention_heads=2"):
        apply_parallelism(hunyuan, single_rank_groups(), ParallelConfig(ulysses_degree=4))
    with pytest.raises(ConfigError, match="ulysses_degree=2 needs a sequence-parallel group of 2 ranks"):
        enable_hunyuan_video15_sequence_parallel(hunyuan.denoiser, 2, lambda: SequenceMesh.ulysses(None, 2))
    with pytest.raises(ConfigError, match=r"QwenImageTransformer2DModel is not a HunyuanVideo15Transformer3DModel"):
        enable_hunyuan_video15_sequence_parallel(type("QwenImageTransformer2DModel", (torch.nn.Module,), {})(), 2,
                                                 lambda: SequenceMesh.ulysses(None, 2))
    attn = hunyuan.denoiser.transformer_blocks[0].attn
    original = attn.processor
    attn.fuse_projections()
    try:
        with pytest.raises(ConfigError, match=r"transformer_blocks\.0\.attn has fused q/k/v projections"):
            enable_hunyuan_video15_sequence_parallel(hunyuan.denoiser, 2, lambda: SequenceMesh.ulysses(None, 2))
    finally:                             # diffusers' Attention has no unfuse: drop the fused layers it added
        attn.fuse_projections(fuse=False)
        del attn.to_qkv, attn.to_added_qkv
    attn.set_processor(object())
    try:
        with pytest.raises(ConfigError, match=r"transformer_blocks\.0\.attn uses object; only diffusers' "
                                              r"HunyuanVideo15AttnProcessor2_0 is sharded"):
            enable_hunyuan_video15_sequence_parallel(hunyuan.denoiser, 2, lambda: SequenceMesh.ulysses(None, 2))
    finally:
        attn.set_processor(original)
    assert sharded_attentions(hunyuan) == 0 and not hasattr(hunyuan.denoiser, "_diffstage_sequence_parallel")
