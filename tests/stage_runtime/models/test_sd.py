"""StableDiffusionPipeline: its facts (equal to the bare call in request and step mode, abort and progress: its
``FAMILY`` row in the checklist, test_families.py; the engine's own tests run on it too)."""

from __future__ import annotations

import pytest
import torch
from family_checks import Family

from stage_runtime.config import ModelConfig
from stage_runtime.model_info import ModelInfo
from stage_runtime.models.registry import resolve_adapter_class

torch.set_num_threads(1)
FAMILY = Family("sd")


@pytest.fixture(scope="module")
def sd_adapter(tiny_sd_path):
    return resolve_adapter_class(ModelConfig(path=tiny_sd_path)).load(tiny_sd_path, torch.device("cpu"))


def test_sd_model_info(sd_adapter):
    info = sd_adapter.info()
    assert isinstance(info, ModelInfo)
    assert info == ModelInfo(
        pipeline_class="StableDiffusionPipeline", adapter="stage_runtime.models.families.sd:StableDiffusionAdapter",
        default_height=64, default_width=64, default_steps=20, default_guidance=7.5, size_multiple=8,
        fixed_size=False, supports_request_batch=True, num_attention_heads=4, max_steps=999,
        supports_step_execution=type(sd_adapter).supports_step_execution, parallel_kinds=("cfg", "ulysses"),
        guidance="cfg", max_sequence_length=77, edit_tasks=("img2img", "inpaint"),
        lora_components=("unet", "text_encoder"))
    assert sd_adapter.denoiser is sd_adapter.pipe.unet
