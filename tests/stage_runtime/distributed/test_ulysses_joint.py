"""Joint-sequence Ulysses, the parts that need no second rank: the shard plan and the load-time refusals
(the 2-rank equality runs in test_mmdit_parallel.py)."""

from __future__ import annotations

import pytest
import torch
from diffusers import DiffusionPipeline

from stage_runtime.distributed.ulysses_joint import _shard_rotary, chunk_sizes, enable_joint_ulysses, \
    joint_attention_heads
from stage_runtime.errors import ConfigError


@pytest.mark.parametrize(("length", "parts"), [(333, 2), (512, 2), (256, 4), (7, 3), (2, 2)])
def test_chunk_sizes_are_torch_tensor_split_chunks(length, parts):
    assert chunk_sizes(length, parts) == [len(c) for c in torch.tensor_split(torch.arange(length), parts)]


def test_rotary_rows_follow_each_ranks_text_then_image_tokens():
    text, image = 5, 4                          # rows 0..4 text, 5..8 image
    table = torch.arange(text + image).float().unsqueeze(1)
    rows = [_shard_rotary((table, table), text, chunk_sizes(text, 2), chunk_sizes(image, 2), r)[0].flatten().tolist()
            for r in range(2)]
    assert rows == [[0, 1, 2, 5, 6], [3, 4, 7, 8]]


@pytest.fixture(scope="module")
def transformers(tiny_flux_path, tiny_sd3_path):
    return {kind: DiffusionPipeline.from_pretrained(path, local_files_only=True).transformer
            for kind, path in (("flux", tiny_flux_path), ("sd3", tiny_sd3_path))}


@pytest.mark.parametrize("kind", ["flux", "sd3"])
def test_refusals_at_load_name_the_reason_and_install_nothing(transformers, kind):
    transformer = transformers[kind]
    assert joint_attention_heads(transformer) == 2
    with pytest.raises(ConfigError, match=r"ulysses_degree=4 does not divide .*num_attention_heads=2"):
        enable_joint_ulysses(transformer, None, 4)
    with pytest.raises(ConfigError, match="ulysses_degree=2 needs a sequence-parallel group of 2 ranks"):
        enable_joint_ulysses(transformer, None, 2)
    assert not any(type(m.processor).__name__ == "JointUlyssesProcessor"
                   for m in transformer.modules() if hasattr(m, "processor") and hasattr(m, "heads"))
