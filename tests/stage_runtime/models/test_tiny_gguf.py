"""The GGUF writer (models/tiny/gguf_file.py) and its key layouts (models/tiny/gguf_layouts.py): the original layouts
are what diffusers' own single-file converters turn back into the model's state dict, value for value (FLUX.1 at
FLUX.1's width, which its converter assumes; Wan 2.1 at the tiny width); every quant type the writer makes loads
through ``load_gguf_pipeline`` within that type's rounding of the float weights; the k-quants cannot be written."""

from __future__ import annotations

import shutil

import diffusers
import gguf
import pytest
import torch
from accelerate import init_empty_weights
from diffusers.loaders.single_file_utils import (convert_flux_transformer_checkpoint_to_diffusers,
                                                 convert_wan_transformer_to_diffusers)
from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor

from stage_runtime.config import ModelConfig, QuantizationConfig
from stage_runtime.models.families.flux import FluxAdapter
from stage_runtime.models.tiny.gguf_file import WRITABLE, write_folder_gguf
from stage_runtime.models.tiny.gguf_layouts import flux_original, to_layout
from stage_runtime.quantization.gguf import load_gguf_pipeline
from stage_runtime.quantization.weight_bytes import module_bytes

# FLUX.1 [dev]'s transformer config, with two blocks of each kind (the converter reads the counts from the keys)
FLUX1 = {"patch_size": 1, "in_channels": 64, "num_layers": 2, "num_single_layers": 2, "attention_head_dim": 128,
         "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768, "guidance_embeds": True,
         "axes_dims_rope": (16, 56, 56)}
# The worst error of a dequantized weight, relative to its tensor's largest: each type's rounding bound — half a step
# of 127 (Q8_0), 16 (Q5_0) or 8 (Q4_0) steps from zero to the block's largest weight (the far end clamps a whole step:
# 1/16, 1/8), half a step of 31 or 15 across the block's range (Q5_1, Q4_1: up to 2/62, 2/30), bfloat16's and float16's
# mantissas — plus the float16 block scales' own rounding. Measured on the tiny FLUX.1: Q8_0 0.45 %, Q5_1 3.3 %, Q5_0
# 6.2 %, Q4_1 6.8 %, Q4_0 12.5 %, BF16 0.31 %, F16 0.04 %.
ERROR_BOUND = {"Q8_0": 0.005, "Q5_1": 0.035, "Q5_0": 0.065, "Q4_1": 0.07, "Q4_0": 0.13, "BF16": 0.004, "F16": 0.0005,
               "F32": 0.0}


def numbered(shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """A state dict of those row counts, one column, every value distinct: the converters cut and join rows only."""
    out, start = {}, 0
    for name, shape in shapes.items():
        column = torch.arange(start, start + shape[0], dtype=torch.float64)
        out[name] = column.reshape(shape[0], *(1,) * (len(shape) > 1))
        start += shape[0]
    return out


def test_flux1s_original_layout_is_what_diffusers_converter_turns_back_into_the_state_dict():
    with init_empty_weights():
        model = diffusers.FluxTransformer2DModel(**FLUX1)
    ours = numbered({name: t.shape for name, t in model.state_dict().items()})
    bfl = flux_original(ours)
    assert bfl["double_blocks.0.img_attn.qkv.weight"].shape[0] == 3 * 3072
    assert bfl["single_blocks.1.linear1.weight"].shape[0] == 3 * 3072 + 4 * 3072
    assert not any(name.startswith(("transformer_blocks", "time_text_embed", "norm_out")) for name in bfl)
    back = convert_flux_transformer_checkpoint_to_diffusers(dict(bfl))
    assert back.keys() == ours.keys()
    assert all(torch.equal(back[name], ours[name]) for name in ours)


def test_wans_original_layout_is_what_diffusers_converter_turns_back_into_the_state_dict(tiny_wan_path):
    model = diffusers.WanTransformer3DModel.from_pretrained(tiny_wan_path, subfolder="transformer",
                                                            local_files_only=True)
    ours = model.state_dict()
    original = to_layout("WanTransformer3DModel", ours, "original")
    assert {"head.modulation", "blocks.0.self_attn.q.weight", "blocks.1.norm3.weight", "blocks.0.ffn.2.bias",
            "time_projection.1.weight", "head.head.weight"} <= original.keys()
    back = convert_wan_transformer_to_diffusers(dict(original))
    assert back.keys() == ours.keys()
    assert all(torch.equal(back[name], ours[name]) for name in ours)


@pytest.fixture(scope="module")
def flux(tiny_flux_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("writer") / "tiny-flux"
    shutil.copytree(tiny_flux_path, folder)
    return folder


@pytest.mark.parametrize("quant", WRITABLE)
def test_each_quant_type_written_loads_within_its_rounding_of_the_float_weights(flux, quant):
    path = write_folder_gguf(flux, quant)
    assert path == flux / f"transformer.{quant}.gguf"
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert types["transformer_blocks.0.attn.to_q.weight"] == quant and types["x_embedder.weight"] == "F32"
    denoiser = load_gguf_pipeline(FluxAdapter, ModelConfig(path=str(flux)),
                                  QuantizationConfig(method="gguf", file=path.name), torch.device("cpu")).denoiser
    float32 = diffusers.FluxTransformer2DModel.from_pretrained(flux, subfolder="transformer", local_files_only=True)
    loaded = denoiser.state_dict()
    worst = 0.0
    for name, weight in float32.state_dict().items():
        tensor = loaded[name]
        assert isinstance(tensor, GGUFParameter) == (types[name] not in ("F32", "F16")), name
        error = (dequantize_gguf_tensor(tensor).float() - weight).abs().max() / weight.abs().max()
        worst = max(worst, float(error))
    assert worst <= ERROR_BOUND[quant], worst
    # diffusers reads F16 and F32 tensors as plain ones in the compute dtype: no fewer bytes resident
    assert (module_bytes(denoiser) < module_bytes(float32)) == (quant not in ("F32", "F16"))


def test_the_k_quants_cannot_be_written_with_gguf_0_19(flux):
    with pytest.raises(NotImplementedError):
        gguf.quantize(torch.ones(1, 256).numpy(), gguf.GGMLQuantizationType.Q4_K)
    with pytest.raises(ValueError, match=r"^--gguf Q4_K: this writer makes Q8_0, .* \(gguf's quantizers that "
                                         r"diffusers reads; gguf 0\.19\.0 cannot write the k-quants\)$"):
        write_folder_gguf(flux, "Q4_K")
