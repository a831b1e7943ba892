"""Pipeline registry (model_index.json → adapter) and the adapter override (each family's own facts: its test module)."""

from __future__ import annotations

import json

import pytest
import torch

from stage_runtime import model_catalog
from stage_runtime.config import ModelConfig
from stage_runtime.errors import ModelLoadError
from stage_runtime.models.families.dit import DiTAdapter
from stage_runtime.models.families.sd import StableDiffusionAdapter
from stage_runtime.plugins import import_object
from stage_runtime.models.registry import (ADAPTERS, GENERIC, MOVED_TO_FAMILIES, current_adapter_path,
                                           read_pipeline_class, resolve_adapter_class, resolve_adapter_path)


def write_index(folder, content) -> str:
    (folder / "model_index.json").write_text(content if isinstance(content, str) else json.dumps(content))
    return str(folder)


# -- read_pipeline_class / resolution ----------------------------------------------------------------------------
def test_read_pipeline_class_of_tiny_models(tiny_sd_path, tiny_dit_path):
    assert read_pipeline_class(tiny_sd_path) == "StableDiffusionPipeline"
    assert read_pipeline_class(tiny_dit_path) == "DiTPipeline"
    assert resolve_adapter_class(ModelConfig(path=tiny_sd_path)) is StableDiffusionAdapter
    assert resolve_adapter_class(ModelConfig(path=tiny_dit_path)) is DiTAdapter


def test_missing_model_index(tmp_path):
    with pytest.raises(ModelLoadError, match="no model_index.json"):
        read_pipeline_class(tmp_path)
    with pytest.raises(ModelLoadError, match="no model_index.json"):
        resolve_adapter_class(ModelConfig(path=str(tmp_path / "nope")))


def test_unreadable_model_index(tmp_path):
    with pytest.raises(ModelLoadError, match="unreadable model_index.json"):
        read_pipeline_class(write_index(tmp_path, "{not json"))
    with pytest.raises(ModelLoadError, match="unreadable model_index.json"):
        read_pipeline_class(write_index(tmp_path, {"_diffusers_version": "0.42.1"}))


def test_model_index_that_is_not_an_object_is_a_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="model_index.json"):
        read_pipeline_class(write_index(tmp_path, ["StableDiffusionPipeline"]))


@pytest.mark.parametrize(("pipeline_class", "adapter"), [
    ("FluxPipeline", "stage_runtime.models.families.flux:FluxAdapter"),
    ("FluxKontextPipeline", "stage_runtime.models.families.flux_kontext:FluxKontextAdapter"),
    ("StableDiffusion3Pipeline", "stage_runtime.models.families.sd3:StableDiffusion3Adapter"),
])
def test_mmdit_families_resolve_by_model_index_class(tmp_path, pipeline_class, adapter):
    path = write_index(tmp_path, {"_class_name": pipeline_class, "_diffusers_version": "0.42.1"})
    assert resolve_adapter_path(ModelConfig(path=path)) == adapter


def test_a_class_without_a_dedicated_adapter_resolves_to_the_generic_one(tmp_path):
    path = write_index(tmp_path, {"_class_name": "StableDiffusionPAGPipeline", "_diffusers_version": "0.42.1"})
    assert resolve_adapter_path(ModelConfig(path=path)) == GENERIC
    assert {"StableDiffusionPipeline", "DiTPipeline", "StableDiffusionXLPipeline", "QwenImagePipeline"} <= set(ADAPTERS)


def test_adapter_override_wins_without_reading_the_folder(tmp_path):
    path = write_index(tmp_path, {"_class_name": "FluxPipeline"})
    model = ModelConfig(path=path, adapter="adapters_for_tests:RecordingSDAdapter")
    assert resolve_adapter_path(model) == "adapters_for_tests:RecordingSDAdapter"
    cls = resolve_adapter_class(model)
    assert cls.__name__ == "RecordingSDAdapter" and issubclass(cls, StableDiffusionAdapter)
    # The folder is not even looked at when an adapter is given.
    assert resolve_adapter_class(ModelConfig(path=str(tmp_path / "absent"),
                                             adapter="stage_runtime.models.families.dit:DiTAdapter")) is DiTAdapter


@pytest.mark.parametrize("adapter", ["no_such_module_xyz:Adapter", "stage_runtime.models.families.sd:NoSuchAdapter"])
def test_bad_adapter_import_path(tiny_sd_path, adapter):
    with pytest.raises(ModelLoadError, match=f"cannot import '{adapter}'"):
        resolve_adapter_class(ModelConfig(path=tiny_sd_path, adapter=adapter))
    with pytest.raises(ModelLoadError, match="cannot import"):
        import_object(adapter)


# -- a family module's old place (before stage_runtime.models.families) ----------------------------------------
def test_an_adapter_at_its_old_place_resolves_to_the_family_module(tiny_sd_path):
    old = "stage_runtime.models.sd:StableDiffusionAdapter"
    model = ModelConfig(path=tiny_sd_path, adapter=old)
    assert resolve_adapter_path(model) == "stage_runtime.models.families.sd:StableDiffusionAdapter"
    assert resolve_adapter_class(model) is StableDiffusionAdapter
    assert StableDiffusionAdapter.load(tiny_sd_path, torch.device("cpu")).info().adapter == \
        "stage_runtime.models.families.sd:StableDiffusionAdapter"       # ModelInfo names the new place


def test_only_the_moved_family_modules_are_mapped():
    assert {p.stem for p in model_catalog.FAMILIES_DIR.glob("*.py")} >= MOVED_TO_FAMILIES
    assert not any((model_catalog.MODELS_DIR / f"{name}.py").exists() for name in MOVED_TO_FAMILIES)
    for name in MOVED_TO_FAMILIES:
        assert current_adapter_path(f"stage_runtime.models.{name}:X") == f"stage_runtime.models.families.{name}:X"
    for same in ("stage_runtime.models.registry:X", "stage_runtime.models.families.sd:StableDiffusionAdapter",
                 "stage_runtime.models.tiny.sd:X", "my_plugins.sd:MyAdapter", "adapters_for_tests:RecordingSDAdapter"):
        assert current_adapter_path(same) == same


def test_malformed_adapter_path_rejected_by_config():
    with pytest.raises(ValueError, match="package.module:ClassName"):
        ModelConfig(path="/x", adapter="not a path")


# -- ModelInfo follows the adapter class ------------------------------------------------------------------------
def test_model_info_reflects_the_adapter_declarations(tiny_sd_path):
    cls = resolve_adapter_class(ModelConfig(path=tiny_sd_path, adapter="adapters_for_tests:SingleRequestSDAdapter"))
    info = cls.load(tiny_sd_path, torch.device("cpu")).info()
    assert info.adapter == "adapters_for_tests:SingleRequestSDAdapter"
    assert info.pipeline_class == "StableDiffusionPipeline"
    assert info.supports_request_batch is False


# -- the families package: one module per family, its facts beside its sequence-parallel hook ------------------
# a module of models/families/ that is not a family is the private helper of exactly one (which imports it)
FAMILY_HELPERS = {"sdxl_edits": "sdxl", "flux_edits": "flux", "qwen_vl_processor": "qwen_image_edit",
                  "wan_ulysses": "wan"}
SKELETON = ("stage_runtime.distributed.ulysses", "stage_runtime.distributed.ulysses_joint")


def test_every_family_module_declares_its_adapters_and_its_sequence_parallel_hook():
    modules = {p.stem for p in model_catalog.FAMILIES_DIR.glob("*.py")} - {"__init__"}
    families = {f.module_path.stem for f in model_catalog.families()} | {"generic"}   # generic: registry.GENERIC
    assert modules == families | set(FAMILY_HELPERS)
    for helper, family in FAMILY_HELPERS.items():
        assert f"from stage_runtime.models.families.{helper} import" in \
            (model_catalog.FAMILIES_DIR / f"{family}.py").read_text()
    for family in model_catalog.families():
        cls = import_object(family.adapter)
        assert cls.pipeline_classes == family.pipeline_classes and family.module_path.is_file()
        hook = cls.sequence_parallel
        assert callable(hook), f"{family.adapter}.sequence_parallel={hook!r}"
        # declared in the class body (its own or a base's): the shared skeleton, or an installer of the declaring
        # family's own module (or of its *_ulysses sibling)
        owner = next(k for k in cls.__mro__ if "sequence_parallel" in vars(k)).__module__
        assert hook.__module__ in (*SKELETON, owner, f"{owner}_ulysses"), f"{family.adapter}: {hook.__module__}"
    assert not hasattr(import_object(GENERIC), "sequence_attention")      # the hook replaced the string


def test_the_sequence_parallel_hook_is_what_enable_sequence_parallel_runs():
    from stage_runtime.distributed import ulysses
    from stage_runtime.errors import ConfigError
    from stage_runtime.models.adapter import PipelineAdapter
    from stage_runtime.models.families.qwen_image import QwenImageAdapter, enable_qwen_sequence_parallel

    assert PipelineAdapter.sequence_parallel is ulysses.enable_sequence_parallel
    assert StableDiffusionAdapter.sequence_parallel is ulysses.enable_sequence_parallel    # the default skeleton
    assert QwenImageAdapter.sequence_parallel is enable_qwen_sequence_parallel            # beside its facts
    calls = []

    class Recording(StableDiffusionAdapter):
        sequence_parallel = staticmethod(lambda denoiser, degree, make_mesh: calls.append((denoiser, degree, make_mesh)))
        denoiser = "the denoiser"

    adapter, make_mesh = object.__new__(Recording), object()
    adapter.enable_sequence_parallel(2, make_mesh)
    assert calls == [("the denoiser", 2, make_mesh)]
    Recording.sequence_parallel = "joint"                                  # the string of before: a clear error
    with pytest.raises(ConfigError, match="Recording.sequence_parallel='joint' is not an installer"):
        adapter.enable_sequence_parallel(2, make_mesh)
    Recording.sequence_parallel = staticmethod(ulysses.enable_sequence_parallel)
    Recording.sequence_attention = "wan"                                   # an adapter written before the hook
    with pytest.raises(ConfigError, match=r"Recording.sequence_attention='wan' is no longer read: declare the "
                                          r"installer itself, sequence_parallel = staticmethod\(installer\)"):
        adapter.enable_sequence_parallel(2, make_mesh)
    assert calls == [("the denoiser", 2, make_mesh)]                       # neither ran an installer
