"""A LoRA file's tensors as diffusers' own loaders read them: one PEFT factor pair and PEFT's scaling per module.

``pipe.load_lora_weights(file)`` does two things, and this module runs the same diffusers functions in the same
order, stopping short of injecting PEFT layers (the stage serves the factors unfused, models.lora.layer):

1. the pipeline class's ``lora_state_dict`` converts the file's layout — kohya / sd-scripts
   (``lora_unet_…_lora_down.weight`` + ``alpha``), diffusers' older training-script layout
   (``…attn1.to_k.lora.down.weight``), PEFT, and the trainers' layouts each mixin knows (FLUX folds kohya's
   ``alpha`` into the factors, SD/SDXL return it as ``network_alphas``);
2. each component's loader takes the keys under its prefix (``unet.``, ``transformer.``, ``text_encoder.``…),
   renames them to PEFT's (``convert_unet_state_dict_to_peft`` for a denoiser; ``convert_state_dict_to_diffusers``
   then ``convert_state_dict_to_peft`` for a text encoder, which also drops CLIP's old ``text_model.`` level),
   and builds the ``LoraConfig`` from the file's metadata or from the ranks and ``network_alphas``
   (``_create_lora_config``): each module's scaling is then PEFT's ``alpha / r`` (``alpha / sqrt(r)`` with
   rsLoRA), with ``r`` and ``alpha`` looked up in ``rank_pattern`` / ``alpha_pattern`` the way PEFT does.

A file the conversion refuses is a LoraLoadError naming the adapter, the file and diffusers' reason. Nothing
here looks at the served model's modules (models.lora.files checks the fit).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch

from stage_runtime.errors import LoraLoadError

FACTOR_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
BIAS_SUFFIX = ".lora_B.bias"     # PEFT's lora_bias: diffusers turns a Wan file's ``diff_b`` into it
MAX_REASON = 400          # characters of diffusers' own message kept in a refusal (it may list every key)


@dataclass(frozen=True)
class ModuleLora:
    """One adapted module as diffusers would load it: delta(x) = scaling · (B(A(x)) + bias)."""

    key: str            # its lora_A key, "<component>.<module>.lora_A.weight" (as the conversion names it)
    a: torch.Tensor
    b: torch.Tensor
    scaling: float
    bias: torch.Tensor | None = None    # lora_B.bias: diffusers' reading of a ``diff_b`` (CausVid, lightx2v)


@dataclass(frozen=True)
class Source:
    """Where the tensors come from, for the refusals: the adapter's name, its file and keys, the loader's class."""

    name: str
    file: str
    pipeline_class: type
    file_keys: frozenset[str] = frozenset()

    def refuse(self, what: str) -> LoraLoadError:
        return LoraLoadError(f"LoRA adapter {self.name!r} from {self.file!r} {what}")

    def refuse_key(self, key: str, head: str, detail: str = "") -> LoraLoadError:
        """``<head>: key '<key>'<detail>``; a key the conversion renamed says so (the file has another name)."""
        named = f"key {key!r}"
        if key not in self.file_keys:
            named += f" (a key of the file as diffusers' {self.pipeline_class.__name__} converts it)"
        return self.refuse(f"{head}: {named}{detail}")


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= MAX_REASON else text[:MAX_REASON] + " …"


def diffusers_state_dict(source: Source, tensors: dict[str, torch.Tensor], metadata: dict | None,
                         components: dict[str, torch.nn.Module]) -> tuple[dict, dict | None, dict | None]:
    """Step 1: ``(state_dict, network_alphas, metadata)`` from the pipeline class's ``lora_state_dict``, called as
    its ``load_lora_weights`` calls it (SDXL with its UNet's config for kohya's SGM block names; FLUX asking for
    the alphas). ``metadata`` is the file's ``lora_adapter_metadata`` (read by the caller: the tensors are handed
    over in memory, never as a path diffusers would resolve, download or unpickle)."""
    cls = source.pipeline_class
    loader = getattr(cls, "lora_state_dict", None)
    if loader is None:
        raise source.refuse(f"cannot be read: {cls.__name__} has no diffusers LoRA loader")
    kwargs = {"return_lora_metadata": True}
    if "return_alphas" in inspect.signature(loader).parameters:
        kwargs["return_alphas"] = True
    from diffusers.loaders import StableDiffusionXLLoraLoaderMixin

    if issubclass(cls, StableDiffusionXLLoraLoaderMixin) and "unet" in components:
        kwargs["unet_config"] = components["unet"].config
    try:
        out = loader(dict(tensors), **kwargs)
    except Exception as exc:      # the converters raise ValueError, KeyError, AssertionError, NotImplementedError…
        raise source.refuse(f"is not a LoRA file diffusers' {cls.__name__}.lora_state_dict converts: "
                            f"{_reason(exc)}") from None
    if isinstance(out, dict):                     # a loader that returns the state dict alone
        return out, None, metadata
    state_dict, alphas = (out[0], out[1]) if len(out) == 3 else (out[0], None)    # (sd, alphas, md) or (sd, md)
    return state_dict, alphas or None, metadata


def _under(mapping: dict | None, prefix: str) -> dict | None:
    if mapping is None:
        return None
    return {k.removeprefix(f"{prefix}."): v for k, v in mapping.items() if k.startswith(f"{prefix}.")}


def _peft_keys(component: str, module: torch.nn.Module, part: dict) -> dict:
    """Step 2's renaming, as the component's diffusers loader does it."""
    from diffusers.utils import (convert_state_dict_to_diffusers, convert_state_dict_to_peft,
                                 convert_unet_state_dict_to_peft)

    if not component.startswith("text_encoder"):                 # ModelMixin.load_lora_adapter
        return part if "lora_A" in next(iter(part)) else convert_unet_state_dict_to_peft(part)
    part = convert_state_dict_to_peft(convert_state_dict_to_diffusers(part))      # _load_lora_into_text_encoder
    if not hasattr(module, "text_model"):                          # CLIP flattened by recent transformers
        part = {k.removeprefix("text_model."): v for k, v in part.items()}
    return part


def _lora_config(component: str, module: torch.nn.Module, part: dict, alphas: dict | None, metadata: dict | None):
    """Step 2's LoraConfig, from the same inputs diffusers gives ``_create_lora_config`` (in the same order: the
    most common rank and alpha become ``r`` and ``lora_alpha``, the first seen winning a tie)."""
    from diffusers.utils.peft_utils import _create_lora_config

    if component.startswith("text_encoder"):          # ranks of the encoder's attention and MLP projections only
        projections = (".q_proj", ".k_proj", ".v_proj", ".out_proj", ".fc1", ".fc2")
        ranks = {f"{name}.lora_B.weight": part[f"{name}.lora_B.weight"].shape[1] for name, _ in module.named_modules()
                 if name.endswith(projections) and f"{name}.lora_B.weight" in part}
    else:
        ranks = {f"^{k}": v.shape[1] for k, v in part.items() if "lora_B" in k and v.ndim > 1}
    return _create_lora_config(part, alphas, metadata, ranks, is_unet=not component.startswith("text_encoder"))


def _scaling(config, module_path: str) -> tuple[int, float]:
    """(r, scaling) for ``module_path`` as PEFT's LoraModel gives it (rank_pattern / alpha_pattern by PEFT's own
    pattern match, then ``alpha / r`` or rsLoRA's ``alpha / sqrt(r)``)."""
    from peft.utils.other import get_pattern_key

    r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), module_path), config.r)
    alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), module_path), config.lora_alpha)
    return r, (alpha / math.sqrt(r) if config.use_rslora else alpha / r)


def component_modules(source: Source, component: str, module: torch.nn.Module, part: dict, alphas: dict | None,
                      metadata: dict | None) -> dict[str, ModuleLora]:
    """Step 2 for one component: its keys (prefix removed) → module path → factors and scaling."""
    first = f"{component}.{next(iter(part))}"
    try:
        peft = _peft_keys(component, module, part)
        config = _lora_config(component, module, peft, _under(alphas, component), _under(metadata, component))
    except Exception as exc:      # the converters raise ValueError / TypeError / IndexError on layouts they do not know
        raise source.refuse(f"is not a LoRA file diffusers loads into {component} (its first key there "
                            f"{first!r}): {_reason(exc)}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key in sorted(peft):
        suffix = next((s for s in (*FACTOR_SUFFIXES, BIAS_SUFFIX) if key.endswith(s)), None)
        if suffix is None:
            raise source.refuse_key(f"{component}.{key}", "has a tensor that is not a LoRA factor",
                                    " (lora_A.weight / lora_B.weight / lora_B.bias; DoRA magnitudes are not served)")
        pairs.setdefault(key[:-len(suffix)], {})[suffix] = peft[key]
    modules = {}
    for path, factors in pairs.items():
        key = f"{component}.{path}{FACTOR_SUFFIXES[0]}"
        if any(s not in factors for s in FACTOR_SUFFIXES):
            missing = next(s for s in FACTOR_SUFFIXES if s not in factors)
            raise source.refuse(f"has module {component}.{path} without its {missing[1:]}")
        a, b = factors[FACTOR_SUFFIXES[0]], factors[FACTOR_SUFFIXES[1]]
        r, scaling = _scaling(config, path)
        if a.ndim < 2 or r != a.shape[0]:
            raise source.refuse_key(key, "does not fit its own config", f": lora_A has shape {tuple(a.shape)}, the "
                                                                        f"adapter's r for the module is {r}")
        modules[path] = ModuleLora(key, a, b, float(scaling), factors.get(BIAS_SUFFIX))
    if getattr(config, "use_dora", False):
        raise source.refuse(f"is a DoRA adapter ({component}'s config has use_dora); DoRA is not served")
    return modules


def normalise(source: Source, tensors: dict[str, torch.Tensor], metadata: dict | None,
              components: dict[str, torch.nn.Module]) -> dict[str, dict[str, ModuleLora]]:
    """The file's tensors as diffusers would load them into ``components`` (prefix → module): component → module
    path → factors. A key under no component of the served model is refused, naming it (diffusers would skip it)."""
    state_dict, alphas, metadata = diffusers_state_dict(source, tensors, metadata, components)
    if not state_dict:
        raise source.refuse("holds no LoRA factors once diffusers converts it")
    if alphas and metadata:
        raise source.refuse(f"carries both alpha tensors ({next(iter(alphas))!r}, …) and lora_adapter_metadata; "
                            "diffusers refuses the pair")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key in state_dict:                   # in diffusers' order (the file's, sorted, as converted)
        component, _, rest = key.partition(".")
        if not rest or component not in components:
            target = f"targets {component!r}" if rest else "names no component (<component>.<module>…)"
            raise source.refuse_key(key, "matches no module of the served model",
                                    f" {target}, this model's LoRA components are {', '.join(components) or 'none'}")
        parts.setdefault(component, {})[rest] = state_dict[key]
    return {c: component_modules(source, c, components[c], part, alphas, metadata) for c, part in parts.items()}
