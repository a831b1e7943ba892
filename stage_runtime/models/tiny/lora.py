"""Random demo LoRA adapters for the tiny pipelines, so LoRA can be tried on the built-in models without files.

``write_tiny_lora(denoiser, component, out_dir, seed)`` adapts the attention projections (``to_q``, ``to_k``, ``to_v``,
``to_out.0``) of the model's denoiser, as a training script would, and writes them in the format diffusers'
``save_lora_weights`` writes (PEFT keys ``<component>.<module>.lora_A.weight``, the adapter config as
``lora_adapter_metadata``), which :mod:`stage_runtime.models.lora.files` reads. B is not zero (unlike a freshly
initialised adapter), so the adapter visibly changes the image. Same seed, same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from stage_runtime.config import ModelConfig
from stage_runtime.models.lora.files import DEFAULT_WEIGHT_NAME, METADATA_KEY
from stage_runtime.models.registry import resolve_adapter_class

TARGETS = (".to_q", ".to_k", ".to_v", ".to_out.0")
DEMO_ADAPTERS = ("ink", "pixel")       # what `make-tiny-model` writes next to a model whose family takes LoRA


def denoiser_component(model_dir: str | Path) -> str | None:
    """The denoiser LoRA may target ("transformer" or "unet"), or None when the family takes no LoRA."""
    components = resolve_adapter_class(ModelConfig(path=str(model_dir))).lora_components
    return next((c for c in components if c in ("transformer", "unet")), None)


def write_tiny_lora(denoiser: torch.nn.Module, component: str, out_dir: str | Path, seed: int, rank: int = 4,
                    alpha: float = 8.0, gain: float = 0.5) -> Path:
    """A random adapter for ``denoiser`` (the pipeline's ``component``) → ``out_dir/pytorch_lora_weights.safetensors``."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, module in denoiser.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith(TARGETS):
            a = torch.randn(rank, module.in_features, generator=generator) / module.in_features ** 0.5
            b = torch.randn(module.out_features, rank, generator=generator) * gain / rank ** 0.5
            tensors[f"{component}.{name}.lora_A.weight"] = a.contiguous()
            tensors[f"{component}.{name}.lora_B.weight"] = b.contiguous()
    config = {f"{component}.{k}": v for k, v in {"r": rank, "lora_alpha": alpha, "use_rslora": False,
                                                 "target_modules": [t.lstrip(".") for t in TARGETS]}.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / DEFAULT_WEIGHT_NAME
    save_file(tensors, str(path), metadata={METADATA_KEY: json.dumps(config), "format": "pt"})
    path.chmod(0o644)                  # read by the serving container, written by the init container
    return out


def write_demo_loras(model_dir: str | Path) -> list[Path]:
    """``model_dir/loras/<name>`` for each demo adapter, when the family takes LoRA (else nothing)."""
    from diffusers import DiffusionPipeline

    component = denoiser_component(model_dir)
    if component is None:
        return []
    pipe = DiffusionPipeline.from_pretrained(str(model_dir), local_files_only=True)
    denoiser = getattr(pipe, component)
    return [write_tiny_lora(denoiser, component, Path(model_dir) / "loras" / name, seed=i + 1)
            for i, name in enumerate(DEMO_ADAPTERS)]
