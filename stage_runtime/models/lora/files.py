"""Reading a LoRA adapter file and checking it against the served model, before anything is applied.

The format is what diffusers' ``save_lora_weights`` writes (PEFT keys, one safetensors file):

    <component>.<module path>.lora_A.weight    (r, in) Linear | (r, in, kh, kw) Conv2d
    <component>.<module path>.lora_B.weight    (out, r) Linear | (out, r, 1, 1) Conv2d
    metadata["lora_adapter_metadata"]           JSON {"<component>.lora_alpha", ".alpha_pattern", ".use_rslora", ...}

A module's scaling is ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA) as PEFT computes it; without
metadata alpha = r (diffusers' convention: scaling 1). Every key must land on a Linear or Conv2d of a
component the family declares, with shapes that fit; the first key that does not is named in the
refusal, with the adapter's name (LoraLoadError). Nothing here touches the model's weights.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from stage_runtime.errors import LoraLoadError

DEFAULT_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
METADATA_KEY = "lora_adapter_metadata"
_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


@dataclass(frozen=True)
class LoraFactors:
    """One adapted module: delta(x) = B(A(x)) * scaling (conv: A with the base's kernel/stride/padding)."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float


@dataclass(frozen=True)
class LoraWeights:
    """One adapter file, checked: component → module path → factors."""

    name: str
    path: str
    digest: str                                     # sha256 of the file, 16 hex
    modules: dict[str, dict[str, LoraFactors]]

    def summary(self) -> dict:
        ranks = [f.a.shape[0] for mods in self.modules.values() for f in mods.values()]
        return {"name": self.name, "path": self.path, "digest": self.digest, "rank": max(ranks),
                "modules": {c: len(m) for c, m in self.modules.items()},
                "bytes": sum(f.a.nbytes + f.b.nbytes for mods in self.modules.values() for f in mods.values())}


def resolve_path(name: str, path: str, model_dir: str | None) -> str:
    """An absolute ``path`` as given; a relative one inside the served model's folder (adapters that ship with
    the model, e.g. the built-in tiny models' ``loras/ink``), never outside it."""
    if Path(path).is_absolute() or model_dir is None:
        return path
    base = Path(model_dir).resolve()
    full = (base / path).resolve()
    if not full.is_relative_to(base):
        raise LoraLoadError(f"LoRA adapter {name!r}: relative path {path!r} leaves the model folder")
    return str(full)


def weight_file(name: str, path: str) -> Path:
    """The safetensors file: ``path`` itself, or the adapter file in the folder ``path``."""
    p = Path(path)
    if p.is_dir():
        default = p / DEFAULT_WEIGHT_NAME
        candidates = [default] if default.is_file() else sorted(p.glob("*.safetensors"))
        if len(candidates) != 1:
            raise LoraLoadError(f"LoRA adapter {name!r}: folder {path!r} holds {len(candidates)} .safetensors files "
                                f"(give the file, or a folder with {DEFAULT_WEIGHT_NAME})")
        p = candidates[0]
    if not p.is_file():
        raise LoraLoadError(f"LoRA adapter {name!r}: path {path!r} is not a file or folder inside this stage")
    return p


def _component_metadata(metadata: dict | None, component: str) -> dict:
    if not metadata or METADATA_KEY not in metadata:
        return {}
    packed = json.loads(metadata[METADATA_KEY])
    prefix = component + "."
    return {k[len(prefix):]: v for k, v in packed.items() if k.startswith(prefix)}


def _alpha(config: dict, module: str, rank: int) -> float:
    """PEFT's alpha for ``module``: alpha_pattern (a suffix regex, as PEFT matches it), else lora_alpha, else r."""
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return float(value)
    return float(config["lora_alpha"]) if config.get("lora_alpha") is not None else float(rank)


def _check_fit(name: str, key: str, module: torch.nn.Module, a: torch.Tensor, b: torch.Tensor) -> None:
    def refuse(reason: str):
        raise LoraLoadError(f"LoRA adapter {name!r} does not fit the served model: key {key!r}: {reason}")

    if isinstance(module, torch.nn.Linear):
        want_a, want_b = (a.shape[0], module.in_features), (module.out_features, a.shape[0])
    elif isinstance(module, torch.nn.Conv2d):
        if module.groups != 1 or module.dilation != (1, 1):
            refuse("grouped or dilated Conv2d layers are not adapted")
        want_a = (a.shape[0], module.in_channels, *module.kernel_size)
        want_b = (module.out_channels, a.shape[0], 1, 1)
    else:
        refuse(f"the module is a {type(module).__name__}; LoRA adapts Linear and Conv2d layers")
    if tuple(a.shape) != want_a:
        refuse(f"lora_A has shape {tuple(a.shape)}, the module needs {want_a}")
    if tuple(b.shape) != want_b:
        refuse(f"lora_B has shape {tuple(b.shape)}, the module needs {want_b}")


def read_lora(name: str, path: str, components: dict[str, torch.nn.Module]) -> LoraWeights:
    """Read and check one adapter file against ``components`` (prefix → module); LoraLoadError if it does not fit."""
    file = weight_file(name, path)
    digest = hashlib.sha256(file.read_bytes()).hexdigest()[:16]
    try:
        with safe_open(str(file), framework="pt") as f:
            metadata, keys = f.metadata(), sorted(f.keys())
            tensors = {k: f.get_tensor(k) for k in keys}
    except Exception as exc:       # safetensors raises its own error types for a corrupt header
        raise LoraLoadError(f"LoRA adapter {name!r}: {str(file)!r} is not a readable safetensors file: {exc}") from None
    if not keys:
        raise LoraLoadError(f"LoRA adapter {name!r}: {str(file)!r} holds no tensors")
    pairs: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key in keys:
        component, _, rest = key.partition(".")
        suffix = next((s for s in _SUFFIXES if rest.endswith(s)), None)
        if suffix is None:
            raise LoraLoadError(f"LoRA adapter {name!r}: key {key!r} is not a diffusers/PEFT LoRA factor "
                                f"(<component>.<module>.lora_A.weight / lora_B.weight; DoRA, biases and "
                                f"kohya-style keys are not served)")
        if component not in components:
            raise LoraLoadError(f"LoRA adapter {name!r} matches no module of the served model: key {key!r} targets "
                                f"{component!r}, this model's LoRA components are {', '.join(components) or 'none'}")
        pairs.setdefault((component, rest[:-len(suffix)]), {})[suffix] = tensors[key]
    modules: dict[str, dict[str, LoraFactors]] = {}
    for (component, module_path), factors in pairs.items():
        key = f"{component}.{module_path}{_SUFFIXES[0]}"
        if len(factors) != 2:
            missing = next(s for s in _SUFFIXES if s not in factors)
            raise LoraLoadError(f"LoRA adapter {name!r}: module {component}.{module_path} has no {missing[1:]}")
        try:
            module = components[component].get_submodule(module_path)
        except AttributeError:
            raise LoraLoadError(f"LoRA adapter {name!r} matches no module of the served model: key {key!r} "
                                f"(no module {module_path!r} in {component})") from None
        a, b = factors[_SUFFIXES[0]], factors[_SUFFIXES[1]]
        _check_fit(name, key, module, a, b)
        config, rank = _component_metadata(metadata, component), a.shape[0]
        alpha = _alpha(config, module_path, rank)
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        weight = module.weight
        modules.setdefault(component, {})[module_path] = LoraFactors(
            a.to(weight.device, weight.dtype), b.to(weight.device, weight.dtype), scaling)
    return LoraWeights(name, path, digest, modules)
