"""FluxKontextPipeline: its facts (its generations equal to the bare call in request and step mode, abort and
progress: its ``FAMILY`` row in the checklist, test_families.py; its instruction edits: engine/test_edit_families.py)."""

from __future__ import annotations

import torch
from family_checks import SIZE, Family

from stage_runtime.config import ModelConfig
from stage_runtime.models.registry import resolve_adapter_class

torch.set_num_threads(1)


def kontext_call(pipe, prompt: str, n: int, guidance: float) -> dict:
    """A generation: no image; ``max_area`` the request's, or the pipeline would rescale to 1024²."""
    return {"prompt": [prompt] * n, "guidance_scale": guidance, "max_area": SIZE * SIZE}


FAMILY = Family("flux-kontext", call=kontext_call, guidances=(3.5, 6.0))


def test_facts(tiny_flux_kontext_path):
    cls = resolve_adapter_class(ModelConfig(path=tiny_flux_kontext_path))
    info = cls.load(tiny_flux_kontext_path, torch.device("cpu")).info()
    assert (info.pipeline_class, info.adapter) == (
        "FluxKontextPipeline", "stage_runtime.models.families.flux_kontext:FluxKontextAdapter")
    assert info.guidance == "distilled" and info.parallel_kinds == () and info.edit_tasks == ("instruct",)
    assert info.step_key == ("height", "width", "task") and info.lora_components == ("transformer", "text_encoder")
