"""What ``load_gguf_pipeline`` refuses, before diffusers reads a weight: each a ConfigError (the stage exits 2) naming
``quantization.file`` and its value (or the family), never a traceback from diffusers — a missing file, one that is no
GGUF, a quant type diffusers does not read, tensors that are not the folder's denoiser (the first named), a quantized
tensor diffusers would use as raw bytes, a family whose denoiser diffusers cannot read from a single file, two
experts."""

from __future__ import annotations

import shutil
from pathlib import Path

import diffusers
import pytest
import torch

from stage_runtime.config import ModelConfig, QuantizationConfig
from stage_runtime.errors import ConfigError
from stage_runtime.models.families.dit import DiTAdapter
from stage_runtime.models.families.flux import FluxAdapter
from stage_runtime.models.tiny.gguf_file import write_folder_gguf, write_gguf
from stage_runtime.models.tiny.gguf_layouts import to_layout
from stage_runtime.models.families.wan import WanAdapter
from stage_runtime.quantization.gguf import load_gguf_pipeline

CPU = torch.device("cpu")
GOOD = "transformer.Q8_0.gguf"
VERSION = diffusers.__version__.replace(".", r"\.")


@pytest.fixture(scope="module")
def flux(tiny_flux_path, tmp_path_factory) -> Path:
    """A copy of the tiny FLUX.1 folder with its Q8_0 GGUF denoiser inside."""
    folder = tmp_path_factory.mktemp("refusals") / "tiny-flux"
    shutil.copytree(tiny_flux_path, folder)
    write_folder_gguf(folder, "Q8_0")
    return folder


@pytest.fixture(scope="module")
def flux_state(flux) -> dict[str, torch.Tensor]:
    return diffusers.FluxTransformer2DModel.from_pretrained(flux, subfolder="transformer",
                                                            local_files_only=True).state_dict()


def load(adapter_cls, folder, file: str):
    return load_gguf_pipeline(adapter_cls, ModelConfig(path=str(folder)), QuantizationConfig(method="gguf", file=file),
                              CPU)


def refused(adapter_cls, folder, file: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load(adapter_cls, folder, file)


def test_a_missing_file_is_refused_with_where_it_was_looked_for(flux):
    refused(FluxAdapter, flux, "flux1-dev-Q8_0.gguf", rf"^quantization\.file='flux1-dev-Q8_0\.gguf': {flux}/flux1-dev"
                                                      r"-Q8_0\.gguf does not exist \(a relative path is read inside "
                                                      rf"model\.path='{flux}'\)$")
    refused(FluxAdapter, flux, "transformer", r"^quantization\.file='transformer': .* is a directory")


def test_a_file_that_is_not_gguf_is_refused(flux, tmp_path):
    refused(FluxAdapter, flux, "transformer/diffusion_pytorch_model.safetensors",
            r"^quantization\.file='transformer/diffusion_pytorch_model\.safetensors': not a GGUF file \(it starts "
            r"with b'.{1,16}', a GGUF file with b'GGUF'\)$")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes((flux / GOOD).read_bytes()[:200])          # a download cut short
    refused(FluxAdapter, flux, str(cut), rf"^quantization\.file='{cut}': not a readable GGUF file \(")


def test_a_quant_type_diffusers_does_not_read_is_named(flux, flux_state, tmp_path):
    write_gguf(flux_state, tmp_path / "mxfp4.gguf", "MXFP4")             # gguf writes it, diffusers cannot read it
    refused(FluxAdapter, flux, str(tmp_path / "mxfp4.gguf"),
            r"'transformer_blocks\.0\.norm1\.linear\.weight' is MXFP4, a quant type diffusers "
            rf"{VERSION} does not read \(it reads F32, F16, .*Q8_0.*Q4_K")


def test_a_missing_tensor_and_a_foreign_one_are_named(flux, flux_state, tmp_path):
    missing = {k: v for k, v in flux_state.items() if k != "transformer_blocks.0.attn.to_k.weight"}
    write_gguf(missing, tmp_path / "missing.gguf")
    refused(FluxAdapter, flux, str(tmp_path / "missing.gguf"),
            r"the file has no tensor for FluxTransformer2DModel's 'transformer_blocks\.0\.attn\.to_k\.weight' \(32, "
            r"32\)$")
    renamed = {k.replace("ff_context", "ff_txt"): v for k, v in flux_state.items()}
    write_gguf(renamed, tmp_path / "renamed.gguf")
    refused(FluxAdapter, flux, str(tmp_path / "renamed.gguf"),
            r"tensor 'transformer_blocks\.0\.ff_txt\.net\.0\.proj\.weight' is not a weight of FluxTransformer2DModel")


def test_a_file_of_another_size_names_the_first_tensor_that_does_not_fit(flux, tmp_path):
    config = dict(diffusers.FluxTransformer2DModel.load_config(flux, subfolder="transformer"))
    wider = diffusers.FluxTransformer2DModel.from_config({**config, "num_attention_heads": 4})   # width 64, not 32
    write_gguf(wider.state_dict(), tmp_path / "wider.gguf")
    refused(FluxAdapter, flux, str(tmp_path / "wider.gguf"),
            r"tensor 'time_text_embed\.timestep_embedder\.linear_1\.weight' has shape \(64, 256\), "
            r"FluxTransformer2DModel of the model\.path's config has \(32, 256\): the file is another size's$")


def test_another_models_file_is_refused_by_diffusers_converter_with_its_first_tensors(flux, tiny_wan_path, tmp_path):
    wan = diffusers.WanTransformer3DModel.from_pretrained(tiny_wan_path, subfolder="transformer")
    write_gguf(to_layout("WanTransformer3DModel", wan.state_dict(), "original"), tmp_path / "wan.gguf")
    refused(FluxAdapter, flux, str(tmp_path / "wan.gguf"),
            r"diffusers' convert_flux_transformer_checkpoint_to_diffusers cannot read the file's tensors as "
            r"FluxTransformer2DModel \(.*\); the file's tensors begin 'head\.modulation', 'patch_embedding\.weight'")


def test_flux1s_original_layout_is_refused_at_a_width_other_than_flux1s(flux, tmp_path):
    """diffusers 0.42.1 splits BFL's fused single-block linear at FLUX.1's own width (3 × 3072 + 12288 rows)."""
    write_folder_gguf(flux, "Q8_0", layout="original", out=tmp_path / "bfl.gguf")
    refused(FluxAdapter, flux, str(tmp_path / "bfl.gguf"),
            r"convert_flux_transformer_checkpoint_to_diffusers cannot read the file's tensors as "
            r"FluxTransformer2DModel \(RuntimeError: split_with_sizes .* 224 .*\[3072, 3072, 3072, 12288\]\); "
            r"the file's tensors begin 'time_in\.in_layer\.weight'")


def test_a_quantized_tensor_outside_a_linear_layer_is_refused(flux, flux_state, tmp_path):
    """diffusers would load a BF16 RMSNorm weight as raw bytes (shape 32 for 16 weights) and fail at the first step."""
    norms = lambda name, array, block_size: name.endswith("attn.norm_q.weight")    # noqa: E731
    write_gguf(flux_state, tmp_path / "norm.gguf", "BF16", select=norms)
    refused(FluxAdapter, flux, str(tmp_path / "norm.gguf"),
            r"tensor 'transformer_blocks\.0\.attn\.norm_q\.weight' is quantized but is the weight of a RMSNorm; "
            r"diffusers computes with quantized tensors only as linear layers' weights$")


def test_a_family_whose_denoiser_diffusers_cannot_read_from_gguf_is_named(flux, tiny_dit_path):
    refused(DiTAdapter, tiny_dit_path, str(flux / GOOD),
            r"^quantization\.method='gguf': the DiTPipeline \(DiTAdapter\) family's denoiser DiTTransformer2DModel "
            rf"cannot be read from a GGUF file by diffusers {VERSION} \(its single-file loader has no "
            r"DiTTransformer2DModel\); measured GGUF families: FLUX\.1, Wan 2\.1$")


def test_a_two_expert_family_is_refused(flux, tiny_wan22_path):
    refused(WanAdapter, tiny_wan22_path, str(flux / GOOD),
            r"^quantization\.method='gguf': the WanPipeline \(WanAdapter\) family in model\.path=.* has two denoisers "
            r"\(transformer and transformer_2, the two experts\); quantization\.file is one denoiser$")


def test_only_method_gguf_is_loaded_here(flux):
    with pytest.raises(ConfigError, match=r"^quantization\.method='int8-weight': load_gguf_pipeline serves"):
        load_gguf_pipeline(FluxAdapter, ModelConfig(path=str(flux)), QuantizationConfig(method="int8-weight"), CPU)
