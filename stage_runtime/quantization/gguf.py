"""``quantization.method: gguf``: the denoiser read from a pre-quantized GGUF file, the rest of the pipeline from the
model folder (docs/quantization-gguf.md).

``load_gguf_pipeline(adapter_cls, model, quant, device)`` loads the denoiser through diffusers' own GGUF loader
(``<DenoiserClass>.from_single_file(file, quantization_config=GGUFQuantizationConfig(compute_dtype=model.dtype),
config=model.path, subfolder=<denoiser>)``: linear weights stay quantized, GGUFParameter, dequantized per forward)
and hands it to the family's own ``load`` as the pipeline's denoiser component, so the folder needs the denoiser's
config but not its weights. Nothing is fetched (``local_files_only``). What diffusers would fail on with a
traceback, or load silently wrong, is a ConfigError first (the stage exits 2) naming ``quantization.file`` and its
value: no such file, not a GGUF file, a quant type diffusers does not read, tensors that are not the denoiser's
(the first one named), a family whose denoiser diffusers cannot read from a single file, a two-expert denoiser.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from stage_runtime.config import ModelConfig, QuantizationConfig
from stage_runtime.errors import ConfigError
from stage_runtime.quantization.gguf_tensors import check_quant_types, match_tensors, read_tensors

log = logging.getLogger(__name__)
# The denoisers whose GGUF path is measured here against the bare diffusers pipeline (tests/stage_runtime/quantization).
MEASURED = {"FluxTransformer2DModel": "FLUX.1", "WanTransformer3DModel": "Wan 2.1"}


def gguf_path(model: ModelConfig, quant: QuantizationConfig) -> Path:
    """``quant.file``, a relative path read inside ``model.path``; ConfigError when there is no such file."""
    given = Path(quant.file)
    path = given if given.is_absolute() else Path(model.path) / given
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ConfigError(f"quantization.file={quant.file!r}: {path} {what} (a relative path is read inside "
                          f"model.path={model.path!r})")
    return path


def read_model_index(model_path: str) -> dict:
    index = Path(model_path) / "model_index.json"
    try:
        return json.loads(index.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.path={model_path!r}: no readable model_index.json ({exc})") from None


def denoiser_class(adapter_cls: type, model_path: str) -> tuple[type, object]:
    """(the folder's denoiser class, diffusers' converter for its original-layout files), or ConfigError naming the
    family when diffusers cannot read that denoiser from a single file."""
    import diffusers
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    index = read_model_index(model_path)
    name = adapter_cls.denoiser_name
    family = f"{index.get('_class_name')} ({adapter_cls.__name__})"
    entry = index.get(name)
    class_name = entry[-1] if isinstance(entry, list) and entry else None
    if class_name is None:
        raise ConfigError(f"quantization.method='gguf': model.path={model_path!r} ({family}) has no {name!r} "
                          "component for the GGUF denoiser to replace")
    second = index.get(f"{name}_2")
    if isinstance(second, list) and second and second[-1] is not None:
        raise ConfigError(f"quantization.method='gguf': the {family} family in model.path={model_path!r} has two "
                          f"denoisers ({name} and {name}_2, the two experts); quantization.file is one denoiser")
    cls = getattr(diffusers, class_name, None)
    loadable = [key for key in SINGLE_FILE_LOADABLE_CLASSES
                if isinstance(cls, type) and issubclass(cls, getattr(diffusers, key, ()))]
    if not loadable:
        raise ConfigError(f"quantization.method='gguf': the {family} family's denoiser {class_name} cannot be read "
                          f"from a GGUF file by diffusers {diffusers.__version__} (its single-file loader has no "
                          f"{class_name}); measured GGUF families: {', '.join(MEASURED.values())}")
    return cls, SINGLE_FILE_LOADABLE_CLASSES[loadable[0]]["checkpoint_mapping_fn"]


def check_gguf_file(adapter_cls: type, model: ModelConfig, quant: QuantizationConfig) -> tuple[Path, type]:
    """Everything checked before diffusers reads a weight: the file, its quant types, the family, its tensors against
    the folder's denoiser config. Returns (the file, the denoiser class)."""
    path = gguf_path(model, quant)
    cls, mapping_fn = denoiser_class(adapter_cls, model.path)
    field = f"quantization.file={quant.file!r}"
    tensors = read_tensors(path, field)
    if not tensors:
        raise ConfigError(f"{field}: the GGUF file holds no tensors")
    check_quant_types(tensors, field)
    try:
        config = cls.load_config(model.path, subfolder=adapter_cls.denoiser_name, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.path={model.path!r}: no readable {adapter_cls.denoiser_name}/config.json for the "
                          f"GGUF denoiser ({exc})") from None
    match_tensors(cls, dict(config), mapping_fn, tensors, field)
    return path, cls


def load_gguf_denoiser(cls: type, path: Path, model: ModelConfig, subfolder: str) -> torch.nn.Module:
    """diffusers' own GGUF loader: linear weights as GGUFParameter (dequantized to the compute dtype per forward),
    the other tensors in ``model.dtype``."""
    from diffusers import GGUFQuantizationConfig

    dtype = getattr(torch, model.dtype)
    return cls.from_single_file(str(path), quantization_config=GGUFQuantizationConfig(compute_dtype=dtype),
                                config=model.path, subfolder=subfolder, dtype=dtype, local_files_only=True)


def load_gguf_pipeline(adapter_cls: type, model: ModelConfig, quant: QuantizationConfig,
                       device: torch.device):
    """The family's pipeline from ``model.path`` with its denoiser (``adapter_cls.denoiser_name``) read from the GGUF
    file ``quant.file``: an instance of ``adapter_cls`` on ``device``, loaded by the family's own ``load``."""
    if quant.method != "gguf" or quant.file is None:
        raise ConfigError(f"quantization.method={quant.method!r}: load_gguf_pipeline serves method 'gguf' with a file")
    path, cls = check_gguf_file(adapter_cls, model, quant)
    if cls.__name__ not in MEASURED:
        log.warning("quantization.method='gguf': %s is read by diffusers' GGUF loader but not measured here (measured: "
                    "%s)", cls.__name__, ", ".join(MEASURED.values()))
    try:
        denoiser = load_gguf_denoiser(cls, path, model, adapter_cls.denoiser_name)
    except ValueError as exc:                  # diffusers' own checks, should one pass ours (check_gguf_file)
        raise ConfigError(f"quantization.file={quant.file!r}: diffusers' GGUF loader refused it: {exc}") from None
    return adapter_cls.load(model.path, device, model.dtype, **{adapter_cls.denoiser_name: denoiser})
