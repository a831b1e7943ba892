"""The quantization methods, each over one pipeline component (docs/quantization.md).

    fp8-storage   diffusers' layerwise casting: every Linear, Conv and Embedding weight stored in float8 e4m3 and
                  cast to the compute dtype right before its layer runs (and back after): half of bfloat16's bytes,
                  any device; the arithmetic is the compute dtype's
    int8-weight   torchao: Linear weights int8 per output channel (Int8WeightOnlyConfig), Embedding tables int8 per
                  row (IntxWeightOnlyConfig), dequantised in the matmul: a quarter of float32's bytes, CPU and GPU
    fp8           torchao: float8 activations and weights (Float8DynamicActivationFloat8WeightConfig), FP8 matmuls:
                  GPUs of compute capability 8.9 or more only

Kept as loaded by every method: norms (no method touches them), the positional and patch embeddings, the first and
last projections (``KEPT``), and what ``quantization.skip`` names; and what the model declares unsafe in low
precision (``declared_keeps``: diffusers' own list for layerwise casting, e.g. Z-Image's ``t_embedder``). The methods never see what a family's adapter
does around the layers: LoRA's per-row hooks, Ulysses' attention processors and the block cache act on the layers'
inputs and outputs, which keep their dtype.
"""

from __future__ import annotations

import re

import torch

from stage_runtime.errors import ConfigError

# Module-name patterns (searched) every method keeps as loaded: the model's ends carry the signal's scale.
KEPT = ("pos_embed", "patch_embed", r"^proj_in$", r"^proj_out", r"^x_embedder$", r"^norm_out")
FP8_MIN_CAPABILITY = (8, 9)


def skipped(name: str, patterns: tuple[str, ...]) -> bool:
    return any(re.search(p, name) for p in (*KEPT, *patterns))


def targets(component: torch.nn.Module, patterns: tuple[str, ...], kinds: tuple[type, ...]) -> list[str]:
    """The names of the layers of ``kinds`` a method quantizes in ``component``."""
    return [name for name, m in component.named_modules() if isinstance(m, kinds) and not skipped(name, patterns)]


def declared_keeps(component: torch.nn.Module) -> tuple[str, ...]:
    """What the model declares unsafe in low precision (diffusers' ``_skip_layerwise_casting_patterns``: code that
    reads a layer's weight dtype to cast its inputs, e.g. Wan's ``condition_embedder``; layers it calls precision
    sensitive, Z-Image's ``t_embedder`` and ``cap_embedder``), its bare ``"norm"`` read as
    the norm layers themselves (a module named norm*), not every layer under one (DiT's class embedding tables live
    under ``norm1`` and store fine: measured with the judge)."""
    declared = getattr(component, "_skip_layerwise_casting_patterns", None) or ()
    return tuple(r"(^|\.)norm[^.]*$" if p == "norm" else p for p in declared)


def fp8_storage(component: torch.nn.Module, patterns: tuple[str, ...], compute_dtype: torch.dtype) -> list[str]:
    from diffusers.hooks import apply_layerwise_casting

    patterns = (*patterns, *declared_keeps(component))
    kinds = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Embedding)
    layers = targets(component, patterns, kinds)
    kept = [name for name, m in component.named_modules() if isinstance(m, kinds) and name not in layers]
    apply_layerwise_casting(component, storage_dtype=torch.float8_e4m3fn, compute_dtype=compute_dtype,
                            skip_modules_pattern=tuple(f"^{re.escape(n)}$" for n in kept))
    return layers


def int8_weight(component: torch.nn.Module, patterns: tuple[str, ...], compute_dtype: torch.dtype) -> list[str]:
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerAxis

    patterns = (*patterns, *declared_keeps(component))
    linears = set(targets(component, patterns, (torch.nn.Linear,)))
    embeddings = set(targets(component, patterns, (torch.nn.Embedding,)))
    if linears:
        quantize_(component, Int8WeightOnlyConfig(), filter_fn=lambda m, name: name in linears)
    if embeddings:
        quantize_(component, IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)),
                  filter_fn=lambda m, name: name in embeddings)
    return sorted(linears | embeddings)


def fp8(component: torch.nn.Module, patterns: tuple[str, ...], compute_dtype: torch.dtype,
        device: torch.device) -> list[str]:
    check_fp8_device(device)
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    patterns = (*patterns, *declared_keeps(component))
    linears = set(targets(component, patterns, (torch.nn.Linear,)))
    quantize_(component, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
              filter_fn=lambda m, name: name in linears)
    return sorted(linears)


def check_fp8_device(device: torch.device) -> None:
    """``fp8`` multiplies in FP8: a CUDA device of compute capability 8.9+ (Ada, Hopper, Blackwell), else ConfigError
    naming the device."""
    if device.type != "cuda":
        raise ConfigError(f"quantization.method='fp8' runs FP8 matmuls, which need a CUDA GPU of compute capability "
                          f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or more; this stage runs on "
                          f"device={device.type!r}: use method 'fp8-storage' (float8 weights, any device) or "
                          "'int8-weight'")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        raise ConfigError(f"quantization.method='fp8' needs compute capability {FP8_MIN_CAPABILITY[0]}."
                          f"{FP8_MIN_CAPABILITY[1]} or more; {torch.cuda.get_device_name(device)} ({device}) has "
                          f"{capability[0]}.{capability[1]}: use method 'fp8-storage' or 'int8-weight'")


METHODS = {"fp8-storage": fp8_storage, "int8-weight": int8_weight}
