"""Reading an adapter file: every layout through diffusers' own conversion (the served pipeline class's
``lora_state_dict``, then PEFT's keys and LoraConfig), PEFT's scaling, and every refusal naming the adapter, the
file and the first key that does not fit."""

from __future__ import annotations

import json
import math

import pytest
import torch
from diffusers import FluxPipeline, StableDiffusionPipeline
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


def read(path, loader=StableDiffusionPipeline):
    return read_lora("a", path, components(), loader)


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
    weights = read(write(tmp_path, factors(), metadata))
    mods = weights.modules["unet"]
    assert mods["block.to_q"].scaling == pytest.approx(q_scale)
    assert mods["block.conv"].scaling == pytest.approx(conv_scale)
    assert len(weights.digest) == 16 and weights.summary()["modules"] == {"unet": 2}


def test_a_folder_is_read_through_its_one_adapter_file(tmp_path):
    write(tmp_path, factors(), name="pytorch_lora_weights.safetensors")
    assert read(str(tmp_path)).modules["unet"].keys() == {"block.to_q", "block.conv"}


def kohya(tensors, alpha):
    """The PEFT factors in kohya's keys (``lora_unet_<path with _>``, lora_down / lora_up, an alpha each)."""
    out = {}
    for key, value in tensors.items():
        module, factor = key.removeprefix("unet.").rsplit(".lora_", 1)
        name = "lora_unet_" + module.replace(".", "_")
        out[f"{name}.lora_{'down' if factor.startswith('A') else 'up'}.weight"] = value
        out[f"{name}.alpha"] = torch.tensor(alpha)
    return out


def test_kohya_and_the_training_script_layout_are_converted_as_diffusers_converts_them(tmp_path):
    """kohya: alpha / r (8 / 2); diffusers' training-script layout (``.lora.down`` / ``.lora.up``, no metadata):
    alpha = r. Each gives the PEFT file's factors."""
    peft = factors()
    from_kohya = read(write(tmp_path, kohya(peft, 8.0), name="k.safetensors")).modules["unet"]
    old = {k.replace(".lora_A.", ".lora.down.").replace(".lora_B.", ".lora.up."): v for k, v in peft.items()}
    from_old = read(write(tmp_path, old, name="o.safetensors")).modules["unet"]
    for module in ("block.to_q", "block.conv"):
        a, b = peft[f"unet.{module}.lora_A.weight"], peft[f"unet.{module}.lora_B.weight"]
        for mods, scaling in ((from_kohya, 4.0), (from_old, 1.0)):
            assert torch.equal(mods[module].a, a) and torch.equal(mods[module].b, b)
            assert mods[module].scaling == pytest.approx(scaling)


def bad(tensors):
    out = factors()
    out.update(tensors)
    return out


@pytest.mark.parametrize("tensors, message", [
    ({"text_encoder.layers.0.q_proj.lora_A.weight": torch.randn(2, 8)},
     "matches no module of the served model: key 'text_encoder.layers.0.q_proj.lora_A.weight' targets "
     "'text_encoder', this model's LoRA components are unet"),
    ({"unet.block.to_k.lora_A.weight": torch.randn(2, 8), "unet.block.to_k.lora_B.weight": torch.randn(6, 2)},
     "matches no module of the served model: key 'unet.block.to_k.lora_A.weight' (no module 'block.to_k' in unet)"),
    ({"unet.block.to_q.lora_A.weight": torch.randn(2, 7)},
     "does not fit the served model: key 'unet.block.to_q.lora_A.weight': lora_A has shape (2, 7), the module "
     "needs (2, 8)"),
    ({"unet.block.conv.lora_B.weight": torch.randn(4, 2, 1, 1)}, "lora_B has shape (4, 2, 1, 1), the module needs"),
    ({"unet.block.norm.lora_A.weight": torch.randn(2, 8), "unet.block.norm.lora_B.weight": torch.randn(8, 2)},
     "the module is a LayerNorm; LoRA adapts Linear and Conv2d layers"),
    ({"lora_unet_block_to_q.lora_down.weight": torch.randn(2, 8)},        # kohya keys among PEFT ones
     "matches no module of the served model: key 'lora_unet_block_to_q.lora_down.weight' targets "
     "'lora_unet_block_to_q'"),
    ({"unet.block.to_q.lora_magnitude_vector": torch.randn(6)},
     "has a tensor that is not a LoRA factor: key 'unet.block.to_q.lora_magnitude_vector' (lora_A.weight / "
     "lora_B.weight / lora_B.bias; DoRA magnitudes are not served)"),
    ({"unet.block.to_q.lora_B.bias": torch.randn(5)}, "lora_B.bias has shape (5,), the module needs (6,)"),
])
def test_refusals_name_the_adapter_the_file_and_the_first_key_that_does_not_fit(tmp_path, tensors, message):
    path = write(tmp_path, bad(tensors))
    with pytest.raises(LoraLoadError) as exc:
        read(path)
    assert str(exc.value).startswith(f"LoRA adapter 'a' from {path!r} ") and message in str(exc.value)


def test_a_key_renamed_by_the_conversion_is_named_as_converted_and_says_so(tmp_path):
    tensors = kohya(factors(), 4.0)
    tensors["lora_unet_block_to_k.lora_down.weight"] = torch.randn(2, 8)
    tensors["lora_unet_block_to_k.lora_up.weight"] = torch.randn(6, 2)
    with pytest.raises(LoraLoadError, match=r"matches no module of the served model: key "
                                            r"'unet\.block\.to_k\.lora_A\.weight' \(a key of the file as diffusers' "
                                            r"StableDiffusionPipeline converts it\) "
                                            r"\(no module 'block\.to_k' in unet\)"):
        read(write(tmp_path, tensors))


def test_a_file_diffusers_refuses_is_refused_with_its_reason(tmp_path):
    """FLUX's loader takes any ``.lora_down.weight`` file for sd-scripts' FLUX layout: an SD kohya file is not."""
    path = write(tmp_path, kohya(factors(), 4.0))
    with pytest.raises(LoraLoadError) as exc:
        read_lora("a", path, {"transformer": torch.nn.ModuleDict({"block": Block()})}, FluxPipeline)
    assert str(exc.value).startswith(f"LoRA adapter 'a' from {path!r} is not a LoRA file diffusers' "
                                     f"FluxPipeline.lora_state_dict converts: ")
    assert "lora_unet_block" in str(exc.value)


def test_a_factor_without_its_pair_and_a_missing_file_are_refused(tmp_path):
    half = {k: v for k, v in factors().items() if k != "unet.block.conv.lora_B.weight"}
    with pytest.raises(LoraLoadError, match="has module unet.block.conv without its lora_B.weight"):
        read(write(tmp_path, half))
    with pytest.raises(LoraLoadError, match="'gone': path '/nowhere' is not a file or folder inside this stage"):
        read_lora("gone", "/nowhere", components(), StableDiffusionPipeline)
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(LoraLoadError, match="is not a readable safetensors file"):
        read(str(tmp_path / "junk.safetensors"))


def test_a_module_that_runs_on_every_rows_tokens_concatenated_is_refused_naming_the_key(tmp_path):
    """Z-Image's patch and caption embedders (``PipelineAdapter.lora_flat_modules``): one image's adapters cannot be
    told from another's there; the blocks are adapted."""
    save_file(factors(), str(tmp_path / "a.safetensors"))
    assert set(read_lora("a", str(tmp_path / "a.safetensors"), components(), StableDiffusionPipeline,
                         {"unet": ("block.norm",)}).modules["unet"]) == {"block.to_q", "block.conv"}
    with pytest.raises(LoraLoadError, match=r"targets a module this stage cannot adapt per request: key "
                                            r"'unet.block.conv.lora_A.weight': unet.block.conv runs on the tokens of "
                                            r"every image of a forward concatenated"):
        read_lora("a", str(tmp_path / "a.safetensors"), components(), StableDiffusionPipeline, {"unet": ("block.conv",)})


def test_a_tensor_parallel_layer_gets_its_shard_of_the_factors_checked_against_the_full_layer(tmp_path):
    """A column-parallel layer keeps B's rows of its outputs, a row-parallel one A's columns of its inputs; the
    shapes are checked against the full layer's."""
    from stage_runtime.distributed.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    full = components()
    sharded = components()
    sharded["unet"].block.to_q = ColumnParallelLinear.shard(full["unet"].block.to_q, torch.tensor([2, 3, 4]))
    tensors = factors()
    save_file(tensors, str(tmp_path / "a.safetensors"))
    q = read_lora("a", str(tmp_path / "a.safetensors"), sharded, StableDiffusionPipeline).modules["unet"]["block.to_q"]
    assert torch.equal(q.a, tensors["unet.block.to_q.lora_A.weight"])
    assert torch.equal(q.b, tensors["unet.block.to_q.lora_B.weight"][2:5])
    sharded["unet"].block.to_q = RowParallelLinear.shard(full["unet"].block.to_q, torch.tensor([4, 5, 6, 7]), None)
    q = read_lora("a", str(tmp_path / "a.safetensors"), sharded, StableDiffusionPipeline).modules["unet"]["block.to_q"]
    assert torch.equal(q.a, tensors["unet.block.to_q.lora_A.weight"][:, 4:])
    assert torch.equal(q.b, tensors["unet.block.to_q.lora_B.weight"])
