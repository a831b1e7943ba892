"""The training run (stage_runtime/train/run.py) on a short slice of the recipe: it writes a loadable pipeline with
the digit labels, a judge and a manifest, and the same recipe gives the same digest again (what lets the shipped
digest be reproduced; the full retrain is ``make train-tiny-check``, ~10-15 min, outside ``make test``)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess

import pytest
import torch
from diffusers import DiffusionPipeline

from stage_runtime.train.recipe import Recipe
from stage_runtime.train.run import file_digest, folder_digest, train_tiny_digits

torch.set_num_threads(1)
# A few steps of every stage at small batches: seconds, yet every part of the run (the real data, the VAE, the DiT,
# the judge, the folder, the scores) runs.
SLICE = Recipe(vae_steps=2, vae_batch=8, dit_steps=3, dit_batch=8, dit_warmup=1, judge_epochs=1, judge_batch=256,
               score_seeds=1)


@pytest.fixture(scope="module")
def sliced(tmp_path_factory):
    out = tmp_path_factory.mktemp("slice")
    return out, train_tiny_digits(out, SLICE, command="slice", log=lambda line: None)


def test_a_run_writes_the_pipeline_the_judge_and_the_manifest(sliced):
    out, manifest = sliced
    assert json.loads((out / "MANIFEST.json").read_text()) == manifest
    assert manifest["recipe"] == SLICE.as_dict() and manifest["command"] == "slice"
    assert manifest["digits_digest"] == folder_digest(out / "digits")
    assert manifest["judge_digest"] == file_digest(out / "digit-judge.safetensors")
    assert manifest["held_out_digits"] == 359 and manifest["generated_score_images"] == 10
    assert 0 <= manifest["judge_held_out_accuracy"] <= 1 and 0 <= manifest["generated_score"] <= 1
    pipe = DiffusionPipeline.from_pretrained(out / "digits", local_files_only=True)
    assert type(pipe).__name__ == "DiTPipeline"
    assert pipe.labels["7"] == pipe.labels["seven"] == 7 and len(pipe.labels) == 20
    assert pipe.transformer.config.num_embeds_ada_norm == 1000          # row 1000: the null class of guidance


def test_the_same_recipe_gives_the_same_digest_and_leaves_torch_as_it_was(sliced, tmp_path):
    _, first = sliced
    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    again = train_tiny_digits(tmp_path, SLICE, command="slice", log=lambda line: None)
    assert torch.equal(torch.rand(2), expected)                       # the caller's RNG state untouched
    assert not torch.are_deterministic_algorithms_enabled() and torch.get_num_threads() == 1
    assert again["digits_digest"] == first["digits_digest"]
    assert again["judge_digest"] == first["judge_digest"]
    assert (again["judge_held_out_accuracy"], again["generated_score"]) == (
        first["judge_held_out_accuracy"], first["generated_score"])


def test_the_digest_is_the_sha256sum_listing_of_the_folder(sliced):
    out, manifest = sliced
    if shutil.which("sha256sum") is None:
        pytest.skip("sha256sum is not installed")
    listing = subprocess.run("find . -type f | LC_ALL=C sort | xargs sha256sum", shell=True, cwd=out / "digits",
                             capture_output=True, check=True).stdout
    assert folder_digest(out / "digits") == hashlib.sha256(listing).hexdigest() == manifest["digits_digest"]
