"""Quantized weights (``quantization:`` in the stage config, stage_runtime/config/quantization.py;
docs/quantization.md).

``quantize(adapter, config, device)`` right after loading (before compile, parallelism and LoRA wrap anything):
every listed component (default: the denoiser, each part of a routed one) through its method
(quantization.methods), and the rank's :class:`WeightReport`: bytes per component before and after, what was
quantized and what was kept. ``method: gguf`` is not applied here: the denoiser is read from its file at load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stage_runtime.config import ConfigError, OffloadConfig, StageConfig
from stage_runtime.quantization.methods import METHODS, fp8
from stage_runtime.quantization.weight_bytes import module_bytes

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class WeightReport:
    """The rank's weights: per pipeline component, its bytes now and, when quantized, as loaded."""

    method: str
    components: dict[str, dict] = field(default_factory=dict)

    def check_offload(self, offload: OffloadConfig) -> None:
        """The offloader moves plain storages: a quantized component it would manage is a ConfigError (the config
        refuses what it can see; the default components, the denoiser, are known once the pipeline is loaded)."""
        quantized = sorted(name for name, c in self.components.items() if c["method"] != "none")
        both = [name for name in quantized if name in offload.components]
        if offload.mode != "none" and both:
            raise ConfigError(f"offload.components lists {', '.join(both)}, quantized with method={self.method!r}: "
                              "the offloader moves plain weight storages; offload only the components left "
                              f"unquantized (quantized: {', '.join(quantized)})")

    def as_dict(self) -> dict:
        return {"method": self.method, "components": self.components,
                "bytes": sum(c["bytes"] for c in self.components.values())}


def quantized_components(adapter, config: StageConfig) -> list[str]:
    names = list(config.quantization.components) or list(adapter.block_holders())
    family = type(adapter.pipe).__name__
    for name in names:
        if not isinstance(getattr(adapter.pipe, name, None), torch.nn.Module):
            raise ConfigError(f"quantization.components: {family} has no module component {name!r} (it has: "
                              f"{', '.join(n for n, v in adapter.pipe.components.items() if isinstance(v, torch.nn.Module))})")
    return names


def quantize(adapter, config: StageConfig, device: torch.device) -> WeightReport:
    """Quantize what the config asks; the report of every module component either way."""
    quant = config.quantization
    chosen = quantized_components(adapter, config) if quant.method not in ("none", "gguf") else []
    report = WeightReport(quant.method)
    compute = DTYPES[config.model.dtype]
    for name, module in adapter.pipe.components.items():
        if not isinstance(module, torch.nn.Module):
            continue
        before = module_bytes(module)
        entry = {"bytes": before, "method": "none"}
        if name in chosen:
            if quant.method == "fp8":
                layers = fp8(module, quant.skip, compute, device)
            else:
                layers = METHODS[quant.method](module, quant.skip, compute)
            entry = {"bytes": module_bytes(module), "bytes_as_loaded": before, "method": quant.method,
                     "layers_quantized": len(layers)}
        report.components[name] = entry
    if quant.method == "gguf":
        for name in adapter.block_holders():
            if name in report.components:
                report.components[name]["method"] = "gguf"
    return report
