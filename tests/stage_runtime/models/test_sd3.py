"""StableDiffusion3Pipeline: its facts (equal to the bare call, step batching of different step counts and of CFG
with unguided requests, abort and progress: its ``FAMILY`` row in the checklist, test_families.py)."""

from __future__ import annotations

import torch
from family_checks import Family

from stage_runtime.config import ModelConfig
from stage_runtime.models.registry import resolve_adapter_class

torch.set_num_threads(1)
# The checklist (test_families.py): CFG and unguided requests share ticks (the step key is the size only).
FAMILY = Family("sd3", guidances=(7.0, 1.0))


def test_facts(tiny_sd3_path):
    adapter = resolve_adapter_class(ModelConfig(path=tiny_sd3_path)).load(tiny_sd3_path, torch.device("cpu"))
    info = adapter.info()
    assert info.adapter == "stage_runtime.models.families.sd3:StableDiffusion3Adapter"
    assert info.guidance == "cfg" and info.parallel_kinds == ("cfg", "ring", "tp", "ulysses")
    assert (info.default_steps, info.default_guidance, info.default_height, info.size_multiple) == (28, 7.0, 64, 4)
    assert info.max_sequence_length == 256 and info.num_attention_heads == 2
    assert info.step_key == ("height", "width")
    assert adapter.parallel_refusal("cfg") is None
