"""The quantization methods over a component (quantization.methods) and the rank's report (quantization.quantize):
what each method quantizes and keeps, the bytes before and after measured on the storages, the numbers staying
close to the unquantized ones, and every refusal naming the field and the value."""

from __future__ import annotations

import pytest
import torch

from stage_runtime.config import ConfigError, ModelConfig, load_config
from stage_runtime.models.registry import resolve_adapter_class
from stage_runtime.models.step_checkpoint import model_fingerprint
from stage_runtime.quantization import quantize
from stage_runtime.quantization.methods import check_fp8_device, skipped
from stage_runtime.quantization.weight_bytes import module_bytes


def load(path: str):
    return resolve_adapter_class(ModelConfig(path=path)).load(path, torch.device("cpu"))


def stage(path: str, **quantization):
    return load_config({"model": {"path": path}, "device": "cpu", "quantization": quantization})


def forward(adapter) -> torch.Tensor:
    denoiser, gen = adapter.denoiser, torch.Generator().manual_seed(0)
    config = denoiser.config
    x = torch.randn(2, config.in_channels, config.sample_size, config.sample_size, generator=gen)
    with torch.inference_mode():
        return denoiser(x, timestep=torch.tensor([10, 500]), class_labels=torch.tensor([1, 2])).sample


@pytest.mark.parametrize("method, dtype_of_kept, storage", [("fp8-storage", torch.float32, torch.float8_e4m3fn),
                                                            ("int8-weight", torch.float32, None)])
def test_a_method_quantizes_the_layers_and_keeps_the_ends(method, dtype_of_kept, storage, tiny_dit_path):
    reference, adapter = load(tiny_dit_path), load(tiny_dit_path)
    before = forward(reference)
    report = quantize(adapter, stage(tiny_dit_path, method=method), torch.device("cpu"))
    entry = report.components["transformer"]
    assert entry["method"] == method and entry["layers_quantized"] > 0
    assert entry["bytes"] < 0.45 * entry["bytes_as_loaded"] and entry["bytes"] == module_bytes(adapter.denoiser)
    assert report.components["vae"] == {"bytes": module_bytes(adapter.pipe.vae), "method": "none"}
    denoiser = adapter.denoiser
    assert denoiser.proj_out_2.weight.dtype == dtype_of_kept and type(denoiser.proj_out_2.weight) is torch.nn.Parameter
    attn = denoiser.transformer_blocks[0].attn1.to_q.weight
    if storage is not None:
        assert attn.dtype == storage
    else:
        assert type(attn).__name__ == "Int8Tensor"
    after = forward(adapter)
    relative = float((after - before).norm() / before.norm())
    assert 0 < relative < 0.1, relative


def test_skip_patterns_keep_what_they_name(tiny_dit_path):
    adapter = load(tiny_dit_path)
    quantize(adapter, stage(tiny_dit_path, method="int8-weight", skip=[r"\.ff\."]), torch.device("cpu"))
    block = adapter.denoiser.transformer_blocks[0]
    assert type(block.ff.net[2].weight) is torch.nn.Parameter
    assert type(block.attn1.to_q.weight).__name__ == "Int8Tensor"
    assert skipped("pos_embed.proj", ()) and skipped("proj_out_1", ()) and not skipped("transformer_blocks.0.ff", ())


def test_fp8_is_refused_off_an_fp8_gpu_naming_the_device(tiny_dit_path):
    with pytest.raises(ConfigError) as info:
        check_fp8_device(torch.device("cpu"))
    words = "quantization.method='fp8' runs FP8 matmuls, which need a CUDA GPU of compute capability 8.9"
    assert words in str(info.value) and "device='cpu'" in str(info.value)
    with pytest.raises(ConfigError):
        quantize(load(tiny_dit_path), stage(tiny_dit_path, method="fp8"), torch.device("cpu"))


def test_an_unknown_component_is_refused_naming_it(tiny_dit_path):
    with pytest.raises(ConfigError) as info:
        quantize(load(tiny_dit_path), stage(tiny_dit_path, method="int8-weight", components=["unet"]),
                 torch.device("cpu"))
    assert "quantization.components: DiTPipeline has no module component 'unet' (it has: " in str(info.value)


def test_a_checkpoint_names_the_quantization_it_was_made_under(tiny_dit_path):
    adapter = load(tiny_dit_path)
    plain, int8 = model_fingerprint(adapter), model_fingerprint(adapter, "int8-weight")
    assert plain != int8 and plain == model_fingerprint(load(tiny_dit_path), "none")


@pytest.mark.parametrize("section, message", [
    ({"offload": {"mode": "model"}},
     "quantization.method='int8-weight' with offload.mode='model': offload.components is empty (every component"),
    ({"offload": {"mode": "layerwise"}}, "quantization.method='int8-weight' with offload.mode='layerwise'"),
    ({"offload": {"mode": "model", "components": ["vae", "unet"]},
      "quantization": {"method": "int8-weight", "components": ["unet"]}},
     "offload.mode='model': offload.components lists unet; the offloader moves plain weight storages"),
    ({"parallel": {"tensor_parallel_size": 2, "num_gpus": 2}},
     "quantization.method='int8-weight' with tensor_parallel_size=2: tensor parallel cuts full-precision weights"),
    ({"quantization": {"method": "gguf"}}, "method='gguf' needs file"),
    ({"quantization": {"method": "int8-weight", "file": "x.gguf"}}, "file is set but method='int8-weight'"),
    ({"quantization": {"method": "int4"}}, "quantization.method='int4': Input should be"),
])
def test_combinations_that_cannot_work_are_refused_at_the_edge(section, message):
    with pytest.raises(ConfigError) as info:
        load_config({"model": {"path": "m"}, "quantization": {"method": "int8-weight"}, **section})
    assert message in str(info.value)
