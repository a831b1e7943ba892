"""What ``stage-runtime validate`` says DLO puts on each rank, read from the safetensors headers alone: the same
units and bytes the runtime's gather tier builds (tests/stage_runtime/offload/test_dlo_engine.py compares them with a
running stage), the padding rule shared with the tier, and the lines printed."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from stage_runtime.cli import main
from stage_runtime.offload.gather import ALIGN as TIER_ALIGN
from stage_runtime.weight_layout import ALIGN, ComponentLayout, component_layout, denoiser_layouts, describe_dlo


def write_safetensors(path, tensors: dict[str, int]) -> None:
    """A safetensors file with float32 tensors of the given element counts (zeros)."""
    header, at = {}, 0
    for name, count in tensors.items():
        header[name] = {"dtype": "F32", "shape": [count], "data_offsets": [at, at + 4 * count]}
        at += 4 * count
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(at))


def test_the_padding_rule_is_the_tiers():
    assert ALIGN == TIER_ALIGN


def test_blocks_and_head_from_headers_across_shard_files(tmp_path):
    (tmp_path / "transformer").mkdir()
    (tmp_path / "model_index.json").write_text(json.dumps({"transformer": ["diffusers", "X"], "vae": ["d", "V"]}))
    write_safetensors(tmp_path / "transformer" / "a.safetensors",
                      {"pos_embed.proj.weight": 100, "transformer_blocks.0.attn.to_q.weight": 1000})
    write_safetensors(tmp_path / "transformer" / "b.safetensors",
                      {"transformer_blocks.0.ff.weight": 24, "transformer_blocks.1.ff.weight": 500, "proj_out.bias": 3})
    (layout,) = denoiser_layouts(str(tmp_path))
    assert layout.units == {"head": 412, "transformer_blocks.0": 4096, "transformer_blocks.1": 2000}
    assert layout.shard_bytes(2) == 256 + 2048 + 1024           # each unit halved, rounded up to 64 bytes
    assert layout.window_bytes() == 412 + 4096 + 2000
    assert component_layout(tmp_path, "vae") is None


def test_unet_blocks():
    layout = ComponentLayout("unet", {"head": 10, "down_blocks.0": 6400, "mid_block": 128, "up_blocks.0": 64})
    assert layout.shard_bytes(4) == 64 + 1600 + 64 + 64


def test_without_a_readable_model_the_rule_is_printed():
    (line,) = describe_dlo("/nonexistent", 2)
    assert "1/2 of each denoiser block" in line and "--model FOLDER" in line


def test_validate_prints_what_each_rank_holds(capsys, tiny_sd_path):
    assert main(["validate", "--num-gpus", "2", "--enable-distributed-layerwise-offload", "--model", tiny_sd_path]) == 0
    out = capsys.readouterr().out
    assert "offload: distributed  (DLO: all-gather over dp=2; waves of 2 requests)  components: the denoiser" in out
    unet = component_layout(Path(tiny_sd_path), "unet")
    assert f"unet: {unet.nbytes:,} bytes in {len(unet.units)} units (head + {len(unet.units) - 1} blocks)" in out
    for r in (0, 1):
        assert f"dp rank {r}: {unet.shard_bytes(2):,} bytes at rest (0.50× of a full copy)" in out
