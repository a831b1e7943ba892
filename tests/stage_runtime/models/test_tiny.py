"""Tests for the tiny random-weight diffusers pipelines (real objects, CPU, offline)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from transformers import CLIPTokenizer

from stage_runtime.models.tiny import KINDS, TRAINED_KINDS, make_tiny_model
from stage_runtime.models.tiny.clip_tokenizer import build_clip_tokenizer

torch.set_num_threads(1)


def _folder_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _weight_hashes(path: Path) -> dict[str, str]:
    return {
        str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(path.rglob("*.safetensors"))
    }


def _load(path: Path) -> DiffusionPipeline:
    pipe = DiffusionPipeline.from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {kind: make_tiny_model(root / kind, kind=kind, seed=0) for kind in KINDS}


@pytest.fixture(scope="module")
def sd_pipe(built) -> DiffusionPipeline:
    return _load(built["sd"])


@pytest.mark.parametrize(
    ("kind", "class_name"), [("sd", "StableDiffusionPipeline"), ("dit", "DiTPipeline"),
                             ("sdxl", "StableDiffusionXLPipeline"), ("qwen-image", "QwenImagePipeline"),
                             ("flux-kontext", "FluxKontextPipeline")]
)
def test_builds_real_pipeline_folder(built, kind, class_name):
    index = json.loads((built[kind] / "model_index.json").read_text())
    assert index["_class_name"] == class_name
    assert _weight_hashes(built[kind])


def test_sd_folder_is_small(built):
    assert _folder_size(built["sd"]) < 2_000_000


def test_sd_runs_two_steps_with_guidance(sd_pipe):
    out = sd_pipe(
        ["a photo of a cat", "a red car"],
        num_inference_steps=2,
        guidance_scale=7.5,
        height=64,
        width=64,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).images
    assert out.shape == (2, 64, 64, 3)
    assert np.isfinite(out).all()


@pytest.mark.parametrize(("height", "width"), [(32, 32), (48, 48), (96, 64)])
def test_sd_other_sizes(sd_pipe, height, width):
    out = sd_pipe(
        "a dog", num_inference_steps=1, height=height, width=width, output_type="np"
    ).images
    assert out.shape == (1, height, width, 3)


def test_sd_same_generator_seed_is_bitwise_identical(sd_pipe):
    def run():
        return sd_pipe(
            "a photo of a cat",
            num_inference_steps=2,
            output_type="np",
            generator=torch.Generator().manual_seed(123),
        ).images

    assert np.array_equal(run(), run())


def test_sd_attention_heads_split_two_and_four_ways(sd_pipe):
    heads = [m.heads for m in sd_pipe.unet.modules() if type(m).__name__ == "Attention"]
    assert heads and all(h % 4 == 0 for h in heads)


def test_dit_runs_two_steps_with_guidance(built):
    pipe = _load(built["dit"])
    assert pipe.transformer.config.num_attention_heads % 4 == 0
    out = pipe(
        class_labels=[1, 2],
        num_inference_steps=2,
        guidance_scale=4.0,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).images
    assert out.shape == (2, 64, 64, 3)
    assert np.isfinite(out).all()


@pytest.mark.parametrize("kind", KINDS)
def test_same_seed_identical_files_different_seed_differs(built, tmp_path, kind):
    again = make_tiny_model(tmp_path / "again", kind=kind, seed=0)
    other = make_tiny_model(tmp_path / "other", kind=kind, seed=1)
    assert _weight_hashes(again) == _weight_hashes(built[kind])
    if kind in TRAINED_KINDS:                 # trained, shipped weights: every seed writes the same files
        assert _weight_hashes(other) == _weight_hashes(again)
        return
    other_hashes = _weight_hashes(other)
    assert other_hashes.keys() == _weight_hashes(again).keys()
    assert all(other_hashes[k] != v for k, v in _weight_hashes(again).items())


def test_caller_rng_state_untouched(tmp_path):
    torch.manual_seed(42)
    expected = torch.rand(3)
    torch.manual_seed(42)
    make_tiny_model(tmp_path / "m", kind="dit", seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_tokenizer_encodes_and_round_trips(tmp_path):
    tok = build_clip_tokenizer()
    ids = tok("a photo of a cat").input_ids
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    inner = ids[1:-1]
    assert len(inner) == 5 and tok.unk_token_id not in inner
    assert tok.pad_token == "<|endoftext|>" and tok.model_max_length == 77
    tok.save_pretrained(tmp_path)
    loaded = CLIPTokenizer.from_pretrained(tmp_path)
    assert loaded("a photo of a cat").input_ids == ids
    assert len(loaded) == len(tok)


def test_qwen2_tokenizer_drops_exactly_the_template_prefix(built, tmp_path):
    """QwenImagePipeline drops the first 34 tokens of its chat template: the tiny vocab encodes them as 34."""
    from diffusers import QwenImagePipeline
    from transformers import Qwen2Tokenizer

    from stage_runtime.models.tiny.qwen2_tokenizer import build_qwen2_tokenizer

    pipe = QwenImagePipeline.from_pretrained(built["qwen-image"], local_files_only=True)
    prefix = pipe.prompt_template_encode.split("{}")[0]
    tok = build_qwen2_tokenizer()
    assert len(tok(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 34
    ids = tok(pipe.prompt_template_encode.format("a red car")).input_ids
    assert tok.convert_ids_to_tokens(ids[34:37]) == ["a", "Ġred", "Ġcar"]
    assert pipe.tokenizer(pipe.prompt_template_encode.format("a red car")).input_ids == ids
    tok.save_pretrained(tmp_path)
    assert Qwen2Tokenizer.from_pretrained(tmp_path)("a red car").input_ids == tok("a red car").input_ids


def test_tiny_folders_stay_small(built):
    assert _folder_size(built["sdxl"]) < 3_000_000 and _folder_size(built["qwen-image"]) < 3_000_000


def test_unknown_kind_raises(tmp_path):
    with pytest.raises(ValueError, match="bogus"):
        make_tiny_model(tmp_path, kind="bogus")
    with pytest.raises(ValueError, match="kind"):
        make_tiny_model(tmp_path, kind="bogus")


def test_t5_tokenizer_is_a_unigram_t5_tokenizer_fast_that_round_trips(tmp_path):
    from transformers import T5TokenizerFast

    from stage_runtime.models.tiny.t5_tokenizer import build_t5_tokenizer

    tok = build_t5_tokenizer()
    assert isinstance(tok, T5TokenizerFast) and type(tok.backend_tokenizer.model).__name__ == "Unigram"
    ids = tok("a photo of a cat").input_ids
    assert tok.convert_ids_to_tokens(ids) == ["\u2581a", "\u2581photo", "\u2581of", "\u2581a", "\u2581cat", "</s>"]
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id, tok.model_max_length) == (0, 1, 2, 512)
    assert tok.unk_token_id not in tok("Zebra #42!").input_ids          # characters cover other text
    padded = tok("a cat", padding="max_length", max_length=8).input_ids
    assert padded == [ids[0], ids[4], 1, 0, 0, 0, 0, 0]
    tok.save_pretrained(tmp_path)
    loaded = T5TokenizerFast.from_pretrained(tmp_path)
    assert loaded("a photo of a cat").input_ids == ids and len(loaded) == len(tok)


@pytest.mark.parametrize(("kind", "class_name", "blocks"), [
    ("flux", "FluxPipeline", ("transformer_blocks", "single_transformer_blocks")),
    ("sd3", "StableDiffusion3Pipeline", ("transformer_blocks",)),
])
def test_mmdit_kinds_load_and_run_four_steps_at_64(built, kind, class_name, blocks):
    index = json.loads((built[kind] / "model_index.json").read_text())
    assert index["_class_name"] == class_name
    pipe = _load(built[kind])
    assert type(pipe).__name__ == class_name
    heads = [m.heads for m in pipe.transformer.modules() if hasattr(m, "processor") and hasattr(m, "heads")]
    assert heads and all(h == 2 for h in heads)                        # Ulysses 2 splits them
    assert all(len(getattr(pipe.transformer, b)) >= 1 for b in blocks)
    assert _folder_size(built[kind]) < 3_000_000
    out = pipe("a photo of a cat", num_inference_steps=4, height=64, width=64, output_type="np",
               generator=torch.Generator().manual_seed(0)).images
    assert out.shape == (1, 64, 64, 3) and np.isfinite(out).all() and out.std() > 0.04
