"""Reading a LoRA adapter file and checking it against the served model, before anything is applied.

A file is one safetensors file (or a folder holding ``pytorch_lora_weights.safetensors``, or exactly one
``.safetensors``) in any layout the served pipeline's diffusers loader reads: PEFT keys as ``save_lora_weights``
writes them, diffusers' older training-script layout, kohya / sd-scripts, and the trainers' layouts the
family's loader mixin converts. Its tensors go through that conversion (models.lora.normalise: the pipeline
class's ``lora_state_dict``, then each component's PEFT renaming and ``LoraConfig``), so each module's factors and
scaling are what ``load_lora_weights`` would give it. Every module must then be a Linear or Conv2d of a
component the family declares, with factor shapes that fit; the first key that does not is named in the
refusal with the adapter and the file (LoraLoadError). Nothing here touches the model's weights, and the file
is never handed to diffusers as a path (no download, no unpickling).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from stage_runtime.errors import LoraLoadError
from stage_runtime.models.lora.normalise import ModuleLora, Source, normalise

DEFAULT_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
EXPERT_PAIR = ("high_noise_model.safetensors", "low_noise_model.safetensors")   # Wan 2.2 LoRAs as published
METADATA_KEY = "lora_adapter_metadata"          # diffusers' LoRA adapter metadata in the safetensors header


@dataclass(frozen=True)
class LoraFactors:
    """One adapted module: delta(x) = (B(A(x)) + bias) * scaling (conv: A with the base's kernel/stride/padding)."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float
    bias: torch.Tensor | None = None


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
                "bytes": sum(f.a.nbytes + f.b.nbytes + (0 if f.bias is None else f.bias.nbytes)
                             for mods in self.modules.values() for f in mods.values())}


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


def _check_fit(source: Source, m: ModuleLora, module: torch.nn.Module) -> None:
    def refuse(reason: str):
        raise source.refuse_key(m.key, "does not fit the served model", f": {reason}")

    a, b = m.a, m.b
    if isinstance(module, torch.nn.Linear):          # a tensor-parallel shard: the full layer's shapes
        in_features = getattr(module, "full_in_features", module.in_features)
        out_features = getattr(module, "full_out_features", module.out_features)
        want_a, want_b = (a.shape[0], in_features), (out_features, a.shape[0])
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
    if m.bias is not None and tuple(m.bias.shape) != (want_b[0],):
        refuse(f"lora_B.bias has shape {tuple(m.bias.shape)}, the module needs {(want_b[0],)}")


def _within(module_path: str, prefix: str) -> bool:
    return module_path == prefix or module_path.startswith(prefix + ".")


def _read(source_name: str, file: Path) -> tuple[dict[str, torch.Tensor], dict | None]:
    """The file's tensors and its ``lora_adapter_metadata`` (parsed, as diffusers reads it; None without)."""
    try:
        with safe_open(str(file), framework="pt") as f:
            header, tensors = f.metadata() or {}, {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:       # safetensors raises its own error types for a corrupt header
        raise LoraLoadError(f"LoRA adapter {source_name!r}: {str(file)!r} is not a readable safetensors file: "
                            f"{exc}") from None
    if not tensors:
        raise LoraLoadError(f"LoRA adapter {source_name!r}: {str(file)!r} holds no tensors")
    try:
        metadata = json.loads(header[METADATA_KEY]) if header.get(METADATA_KEY) else None
    except json.JSONDecodeError as exc:
        raise LoraLoadError(f"LoRA adapter {source_name!r}: {str(file)!r} has a {METADATA_KEY} that is not JSON: "
                            f"{exc}") from None
    return tensors, metadata


def read_lora(name: str, path: str, components: dict[str, torch.nn.Module], pipeline_class: type,
              flat_modules: dict[str, tuple[str, ...]] | None = None) -> LoraWeights:
    """Read one adapter file through ``pipeline_class``'s diffusers loader and check it against ``components``
    (prefix → module); LoraLoadError naming the adapter, the file and the first key that does not fit, or that
    targets one of ``flat_modules`` (component → module paths whose input is every row's tokens concatenated).
    A tensor-parallel layer's factors are cut to the rank's shard (its ``shard_low_rank``)."""
    digest, modules = hashlib.sha256(), {}
    for file, into in expert_files(name, path, components):
        digest.update(file.read_bytes())
        tensors, metadata = _read(name, file)
        source = Source(name, str(file), pipeline_class, frozenset(tensors))
        served = components if into is None else {"transformer": components[into]}
        for component, parts in normalise(source, tensors, metadata, served).items():
            _check_modules(source, component if into is None else into, parts, components, flat_modules, modules)
    return LoraWeights(name, path, digest.hexdigest()[:16], modules)


def expert_files(name: str, path: str, components: dict[str, torch.nn.Module]) -> list[tuple[Path, str | None]]:
    """The adapter's files, each with the component its ``transformer.`` keys adapt (None: as the keys say). A folder
    holding Wan 2.2's published pair (``high_noise_model.safetensors``, ``low_noise_model.safetensors``, as lightx2v
    ships them) is one adapter of both experts: the high-noise file into ``transformer``, the low-noise one into
    ``transformer_2`` (diffusers: ``load_lora_weights(low, load_into_transformer_2=True)``)."""
    folder = Path(path)
    if folder.is_dir() and all((folder / f).is_file() for f in EXPERT_PAIR):
        if "transformer_2" not in components:
            raise LoraLoadError(f"LoRA adapter {name!r}: folder {path!r} holds a Wan 2.2 pair "
                                f"({', '.join(EXPERT_PAIR)}) for two experts, and this model has one (its LoRA "
                                f"components are {', '.join(components)}); give one of the files")
        return [(folder / EXPERT_PAIR[0], "transformer"), (folder / EXPERT_PAIR[1], "transformer_2")]
    return [(weight_file(name, path), None)]


def _check_modules(source: Source, component: str, parts: dict[str, ModuleLora], components, flat_modules,
                   modules: dict[str, dict[str, LoraFactors]]) -> None:
    """Each converted module of one component checked against the served model and put on its device."""
    for module_path, m in parts.items():
        try:
            module = components[component].get_submodule(module_path)
        except AttributeError:
            raise source.refuse_key(m.key, "matches no module of the served model",
                                    f" (no module {module_path!r} in {component})") from None
        flat = next((p for p in (flat_modules or {}).get(component, ()) if _within(module_path, p)), None)
        if flat is not None:
            raise source.refuse_key(m.key, "targets a module this stage cannot adapt per request", (
                f": {component}.{flat} runs on the tokens of every image of a forward concatenated into one "
                "sequence, so one image's adapters cannot be told from another's (adapt the blocks instead)"))
        _check_fit(source, m, module)
        a, b, bias = m.a, m.b, m.bias
        if hasattr(module, "shard_low_rank"):
            if bias is not None:
                raise source.refuse_key(m.key, "cannot be served under tensor parallel", (
                    f": it carries a LoRA bias ({component}.{module_path}.lora_B.bias, a diff_b), and a bias "
                    "on a tensor-parallel shard is not served; use Ulysses, ring or CFG parallel"))
            a, b = module.shard_low_rank(a, b)
        device, dtype = module.weight.device, compute_dtype(module)
        modules.setdefault(component, {})[module_path] = LoraFactors(
            a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous(), m.scaling,
            None if bias is None else bias.to(device, dtype).contiguous())


def compute_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype an adapted layer computes in, which its factors take. A quantized weight is stored in another:
    a GGUF layer's bytes (its ``compute_dtype``), float8 storage (its layerwise-casting hook's compute dtype);
    a torchao int8 weight reports the dtype it dequantizes to."""
    gguf = getattr(module, "compute_dtype", None)
    if isinstance(gguf, torch.dtype):
        return gguf
    registry = getattr(module, "_diffusers_hook", None)
    casting = registry.get_hook("layerwise_casting") if registry is not None else None
    return casting.compute_dtype if casting is not None else module.weight.dtype
