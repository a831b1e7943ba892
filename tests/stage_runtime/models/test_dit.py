"""DiTPipeline: its facts and class labels (equal to the bare call in request and step mode, abort and progress:
its ``FAMILIES`` rows in the checklist, test_families.py: the random tiny DiT and the trained tiny-digits)."""

from __future__ import annotations

import pytest
import torch
from diffusers import DiTPipeline
from family_checks import Family

from stage_runtime.config import ModelConfig
from stage_runtime.model_info import ModelInfo
from stage_runtime.models.families.dit import DiTAdapter
from stage_runtime.models.refusals import class_id
from stage_runtime.models.registry import resolve_adapter_class
from stage_runtime.request import DiffusionRequest

torch.set_num_threads(1)


def dit_call(pipe, prompt: str, n: int, guidance: float) -> dict:
    """DiTPipeline's own keywords: the prompt's class id, as the adapter maps it (no size: DiT's is fixed)."""
    label = class_id(prompt, getattr(pipe, "labels", None) or {}, pipe.transformer.config.num_embeds_ada_norm)
    return {"class_labels": [label] * n, "guidance_scale": guidance}


FAMILY = Family("dit", call=dit_call, guidances=(4.0, 4.0), sized=False)
# the trained tiny-digits: the same adapter over trained weights (32x32; its own tests: test_tiny_digits.py)
FAMILIES = (FAMILY, Family("digits", call=dit_call, guidances=(4.0, 4.0), sized=False, size=32))


@pytest.fixture(scope="module")
def dit_adapter(tiny_dit_path):
    return resolve_adapter_class(ModelConfig(path=tiny_dit_path)).load(tiny_dit_path, torch.device("cpu"))


def test_dit_model_info(dit_adapter):
    info = dit_adapter.info()
    assert info == ModelInfo(
        pipeline_class="DiTPipeline", adapter="stage_runtime.models.families.dit:DiTAdapter",
        default_height=64, default_width=64, default_steps=20, default_guidance=4.0, size_multiple=8,
        fixed_size=True, supports_request_batch=True, num_attention_heads=4, max_steps=999,
        supports_step_execution=type(dit_adapter).supports_step_execution, parallel_kinds=("cfg", "ring", "tp", "ulysses"),
        guidance="cfg", max_sequence_length=None, num_classes=1000, class_labels=(),
        refusals="stage_runtime.models.refusals:DiTRefusals")
    assert dit_adapter.denoiser is dit_adapter.pipe.transformer
    assert dit_adapter.num_classes == 1000


def test_dit_class_label(dit_adapter):
    assert dit_adapter.class_label("207") == 207
    assert dit_adapter.class_label(" 207 ") == 207
    first = dit_adapter.class_label("a cat")
    assert 0 <= first < 1000
    assert first == 92                                     # CRC32, not hash(): stable across processes
    assert all(dit_adapter.class_label("a cat") == first for _ in range(3))
    assert dit_adapter.class_label("5000") == 5000          # out of range: check_request rejects it


def test_dit_labels_reach_model_info_and_map_prompts_as_the_adapter_does(dit_adapter):
    pipe = DiTPipeline(**dit_adapter.pipe.components, id2label={0: "tench, Tinca tinca", 1: "goldfish"})
    labelled = DiTAdapter(pipe, torch.device("cpu"))
    info = labelled.info()
    assert info.num_classes == 1000 and info.class_labels == (("Tinca tinca", 0), ("goldfish", 1), ("tench", 0))
    for prompt in ("goldfish", "Tinca tinca", "a cat", "999"):
        request = DiffusionRequest("r", prompt).resolve(info)
        DiTAdapter.check_request(request, info)              # admitted, and the rank maps it to the same class
        assert labelled.class_label(prompt) == class_id(prompt, dict(info.class_labels), info.num_classes)
    assert labelled.class_label("goldfish") == 1
