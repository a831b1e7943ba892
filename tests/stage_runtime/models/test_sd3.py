"""StableDiffusion3Pipeline through the engine: equal to the bare pipeline call (with CFG and a negative
prompt), step batching of different step counts and of CFG with no-CFG requests, abort, progress; its facts."""

from __future__ import annotations

import pytest
import torch
from family_checks import (BareCall, check_abort_at_random_steps, check_progress_in_order, check_request_mode,
                           check_step_mode_batches_different_step_counts)

from stage_runtime.config import ModelConfig
from stage_runtime.models.registry import resolve_adapter_class

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def bare(tiny_sd3_path):
    return BareCall(tiny_sd3_path)


def test_facts(tiny_sd3_path):
    adapter = resolve_adapter_class(ModelConfig(path=tiny_sd3_path)).load(tiny_sd3_path, torch.device("cpu"))
    info = adapter.info()
    assert info.adapter == "stage_runtime.models.sd3:StableDiffusion3Adapter"
    assert info.guidance == "cfg" and info.parallel_kinds == ("cfg", "ring", "tp", "ulysses")
    assert (info.default_steps, info.default_guidance, info.default_height, info.size_multiple) == (28, 7.0, 64, 4)
    assert info.max_sequence_length == 256 and info.num_attention_heads == 2
    assert info.step_key == ("height", "width")
    assert adapter.parallel_refusal("cfg") is None


def test_request_mode_equals_the_bare_call(tiny_sd3_path, bare):
    check_request_mode(tiny_sd3_path, bare, guidance=7.0, negative_prompt=None)


def test_step_mode_batches_different_step_counts_with_and_without_cfg(tiny_sd3_path, bare):
    check_step_mode_batches_different_step_counts(tiny_sd3_path, bare, guidances=(7.0, 1.0))


def test_abort_at_random_steps_releases_all_state(tiny_sd3_path):
    check_abort_at_random_steps(tiny_sd3_path)


def test_progress_arrives_in_order(tiny_sd3_path):
    check_progress_in_order(tiny_sd3_path)
