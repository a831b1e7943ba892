"""The built-in tiny-digits (stage_runtime/models/tiny/digits.py): the trained DiT as shipped, bitwise; small; its
labels name the digits; and through the stage engine at its default settings it draws digits the judge reads
(the acceptance figure: >= 80 %)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from stage_runtime.config import ModelConfig, load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.models.registry import resolve_adapter_class
from stage_runtime.models.tiny.digit_judge import TRAINED, load_judge
from stage_runtime.models.tiny.digits import FOLDER
from stage_runtime.train.recipe import Recipe
from stage_runtime.train.run import folder_digest

torch.set_num_threads(1)
MANIFEST = json.loads((TRAINED / "MANIFEST.json").read_text())
DIGITS = [str(d) for d in range(10)]
PER_DIGIT = 8


def test_the_built_folder_is_the_shipped_one_bitwise(tiny_digits_path):
    assert folder_digest(FOLDER) == MANIFEST["digits_digest"]            # the shipped files are the manifest's
    assert folder_digest(tiny_digits_path) == MANIFEST["digits_digest"]  # make-tiny-model --kind digits writes them


def test_the_shipped_model_is_small_and_safetensors():
    files = [p for p in FOLDER.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) == MANIFEST["digits_bytes"] <= 5 * 2 ** 20
    assert {p.suffix for p in files} == {".json", ".safetensors"}


def test_the_package_data_ships_every_trained_file():
    """pyproject's package-data globs (what ``pip install .`` and the runtime image copy) cover the trained folder."""
    root = Path(__file__).resolve().parents[3]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "stage_runtime.models.tiny"]
    package = root / "stage_runtime" / "models" / "tiny"
    shipped = {p for pattern in globs for p in package.glob(pattern) if p.is_file()}
    assert shipped == {p for p in TRAINED.rglob("*") if p.is_file()} and len(shipped) >= 8


def test_the_manifest_is_the_recipe_in_the_code_and_its_command():
    recipe = MANIFEST["recipe"]
    assert Recipe(seed=recipe["seed"], threads=recipe["threads"]).as_dict() == recipe
    assert MANIFEST["command"] == f"stage-runtime train-tiny --seed {recipe['seed']} --threads {recipe['threads']}"


def test_prompts_name_the_digit_by_number_or_word(tiny_digits_path):
    adapter = resolve_adapter_class(ModelConfig(path=tiny_digits_path)).load(tiny_digits_path, torch.device("cpu"))
    info = adapter.info()
    labels = dict(info.class_labels)
    assert {d: labels[d] for d in DIGITS} == {d: int(d) for d in DIGITS}
    assert labels["seven"] == 7 and adapter.class_label("seven") == adapter.class_label("7") == 7
    assert (info.num_classes, info.default_width, info.default_height, info.default_steps) == (1000, 32, 32, 20)


@pytest.fixture(scope="module")
def drawn(tiny_digits_path):
    """Every digit through the engine at the model's default steps and guidance, PER_DIGIT images each."""
    engine = DiffusionEngine.make_engine(load_config({"model": {"path": tiny_digits_path}, "device": "cpu"}))
    try:
        return {d: engine.generate(d, seed=0, num_outputs=PER_DIGIT, timeout=300).images for d in DIGITS}
    finally:
        engine.close()


def test_the_engine_draws_digits_the_judge_reads_at_80_percent_or_more(drawn):
    judge = load_judge()
    found = np.concatenate([judge.classify(drawn[d]) for d in DIGITS])
    asked = np.repeat(np.arange(10), PER_DIGIT)
    score = float((found == asked).mean())
    print(f"judge score of the engine's digits at default settings: {score:.1%} of {len(asked)}")
    assert score >= 0.80, (score, found.reshape(10, PER_DIGIT))
    assert all(drawn[d].shape == (PER_DIGIT, 32, 32, 3) for d in DIGITS)
    assert drawn["1"].std() > 20                                          # a drawing, not a flat field
