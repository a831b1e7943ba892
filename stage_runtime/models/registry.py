"""Pipeline registry: the diffusers class named in ``model_index.json`` → the adapter that serves it.

The table is read from the adapters themselves (``stage_runtime.model_catalog``: each adapter class names its
``pipeline_classes``), never written here. A class without a dedicated adapter is served by the generic diffusers
adapter (request mode only; it says at startup what it cannot do). Entries are import paths, imported only when
a model is loaded (the registry itself never imports torch).
``model.adapter`` in the stage config overrides the lookup with any ``package.module:Class``. The family modules
moved from ``stage_runtime.models`` into ``stage_runtime.models.families``; a config naming one at its old place
(``stage_runtime.models.sd:StableDiffusionAdapter``) still resolves, to the new module (``current_adapter_path``).
"""

from __future__ import annotations

import json
from pathlib import Path

from stage_runtime import model_catalog
from stage_runtime.config import ModelConfig
from stage_runtime.errors import ModelLoadError
from stage_runtime.plugins import import_object

ADAPTERS: dict[str, str] = model_catalog.adapters_by_pipeline()
GENERIC = "stage_runtime.models.families.generic:GenericDiffusersAdapter"
# the family modules that were ``stage_runtime.models.<name>`` before they had a package of their own
MOVED_TO_FAMILIES = frozenset({
    "sd", "sdxl", "sdxl_edits", "sd3", "dit", "flux", "flux_kontext", "flux_edits", "flux2", "flux2_klein", "qwen_image",
    "qwen_image_edit", "qwen_vl_processor", "wan", "wan_vace", "ltx2", "hunyuan_video15", "zimage", "generic"})


def read_pipeline_class(model_path: str | Path) -> str:
    """The ``_class_name`` of a local diffusers pipeline folder."""
    index = Path(model_path) / "model_index.json"
    if not index.is_file():
        raise ModelLoadError(f"model.path={str(model_path)!r}: no model_index.json (not a diffusers pipeline folder)")
    try:
        name = json.loads(index.read_text())["_class_name"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"model.path={str(model_path)!r}: unreadable model_index.json ({exc!r})") from None
    if not isinstance(name, str):
        raise ModelLoadError(f"model.path={str(model_path)!r}: model_index.json _class_name={name!r} is not a string")
    return name


def current_adapter_path(path: str) -> str:
    """``stage_runtime.models.<family>:Class`` (a family module's old place) → ``stage_runtime.models.families.
    <family>:Class``; any other path as it is."""
    module, sep, name = path.partition(":")
    package, _, stem = module.rpartition(".")
    if package == "stage_runtime.models" and stem in MOVED_TO_FAMILIES:
        return f"stage_runtime.models.families.{stem}{sep}{name}"
    return path


def resolve_adapter_path(model: ModelConfig) -> str:
    if model.adapter:
        return current_adapter_path(model.adapter)
    return ADAPTERS.get(read_pipeline_class(model.path), GENERIC)


def resolve_adapter_class(model: ModelConfig) -> type:
    return import_object(resolve_adapter_path(model))
