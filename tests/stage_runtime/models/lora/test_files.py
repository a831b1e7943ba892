"""Reading an adapter file: PEFT's scaling from the metadata, and every refusal naming the adapter and the key."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from stage_runtime.errors import LoraLoadError
from stage_runtime.models.lora.files import read_lora


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q = torch.nn.Linear(8, 6)
        self.conv = torch.nn.Conv2d(3, 5, 3, padding=1)
        self.norm = torch.nn.LayerNorm(8)


def components():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return {"unet": torch.nn.ModuleDict({"block": Block()})}


def factors(r=2):
    return {"unet.block.to_q.lora_A.weight": torch.randn(r, 8), "unet.block.to_q.lora_B.weight": torch.randn(6, r),
            "unet.block.conv.lora_A.weight": torch.randn(r, 3, 3, 3),
            "unet.block.conv.lora_B.weight": torch.randn(5, r, 1, 1)}


def write(tmp_path, tensors, metadata=None, name="adapter.safetensors"):
    path = tmp_path / name
    meta = {"format": "pt"}
    if metadata is not None:
        meta["lora_adapter_metadata"] = json.dumps(metadata)
    save_file(tensors, str(path), metadata=meta)
    return str(path)


@pytest.mark.parametrize("metadata, q_scale, conv_scale", [
    (None, 1.0, 1.0),                                                         # diffusers: alpha = r
    ({"unet.r": 2, "unet.lora_alpha": 8}, 4.0, 4.0),
    ({"unet.r": 2, "unet.lora_alpha": 8, "unet.alpha_pattern": {"conv": 2}}, 4.0, 1.0),
    ({"unet.r": 2, "unet.lora_alpha": 8, "unet.use_rslora": True}, 8 / math.sqrt(2), 8 / math.sqrt(2)),
])
def test_scaling_is_peft_alpha_over_rank(tmp_path, metadata, q_scale, conv_scale):
    weights = read_lora("a", write(tmp_path, factors(), metadata), components())
    mods = weights.modules["unet"]
    assert mods["block.to_q"].scaling == pytest.approx(q_scale)
    assert mods["block.conv"].scaling == pytest.approx(conv_scale)
    assert len(weights.digest) == 16 and weights.summary()["modules"] == {"unet": 2}


def test_a_folder_is_read_through_its_one_adapter_file(tmp_path):
    write(tmp_path, factors(), name="pytorch_lora_weights.safetensors")
    assert read_lora("a", str(tmp_path), components()).modules["unet"].keys() == {"block.to_q", "block.conv"}


def bad(tensors, key):
    out = factors()
    out.update(tensors)
    return out


@pytest.mark.parametrize("tensors, message", [
    ({"text_encoder.layers.0.q_proj.lora_A.weight": torch.randn(2, 8)},
     "LoRA adapter 'a' matches no module of the served model: key 'text_encoder.layers.0.q_proj.lora_A.weight' "
     "targets 'text_encoder', this model's LoRA components are unet"),
    ({"unet.block.to_k.lora_A.weight": torch.randn(2, 8), "unet.block.to_k.lora_B.weight": torch.randn(6, 2)},
     "key 'unet.block.to_k.lora_A.weight' (no module 'block.to_k' in unet)"),
    ({"unet.block.to_q.lora_A.weight": torch.randn(2, 7)},
     "LoRA adapter 'a' does not fit the served model: key 'unet.block.to_q.lora_A.weight': lora_A has shape "
     "(2, 7), the module needs (2, 8)"),
    ({"unet.block.conv.lora_B.weight": torch.randn(4, 2, 1, 1)}, "lora_B has shape (4, 2, 1, 1), the module needs"),
    ({"unet.block.norm.lora_A.weight": torch.randn(2, 8), "unet.block.norm.lora_B.weight": torch.randn(8, 2)},
     "the module is a LayerNorm; LoRA adapts Linear and Conv2d layers"),
    ({"lora_unet_block_to_q.lora_down.weight": torch.randn(2, 8)}, "is not a diffusers/PEFT LoRA factor"),
    ({"unet.block.to_q.lora_magnitude_vector": torch.randn(6)}, "is not a diffusers/PEFT LoRA factor"),
])
def test_refusals_name_the_adapter_and_the_first_key_that_does_not_fit(tmp_path, tensors, message):
    with pytest.raises(LoraLoadError) as exc:
        read_lora("a", write(tmp_path, bad(tensors, None)), components())
    assert message in str(exc.value)


def test_a_factor_without_its_pair_and_a_missing_file_are_refused(tmp_path):
    half = {k: v for k, v in factors().items() if k != "unet.block.conv.lora_B.weight"}
    with pytest.raises(LoraLoadError, match="module unet.block.conv has no lora_B.weight"):
        read_lora("a", write(tmp_path, half), components())
    with pytest.raises(LoraLoadError, match="'gone': path '/nowhere' is not a file or folder inside this stage"):
        read_lora("gone", "/nowhere", components())
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(LoraLoadError, match="is not a readable safetensors file"):
        read_lora("j", str(tmp_path / "junk.safetensors"), components())
