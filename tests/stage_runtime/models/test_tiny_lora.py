"""The demo LoRA adapters `make-tiny-model` ships with a model whose family takes LoRA (loras/ink, loras/pixel):
written by the real CLI, seeded, none for a family without LoRA, named by a path relative to the model folder
(never escaping it), and served equal to diffusers' own load_lora_weights + set_adapters."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from engine_probes import max_diff
from lora_probes import bare_with_loras

from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.errors import LoraLoadError
from stage_runtime.models.lora.files import resolve_path
from stage_runtime.request import DiffusionRequest, SamplingParams


@pytest.fixture(scope="module")
def flux_with_demo_loras(tmp_path_factory) -> str:
    """The CLI run the operator's init container runs, into a fresh folder."""
    out = tmp_path_factory.mktemp("cli") / "tiny-flux"
    done = subprocess.run([sys.executable, "-m", "stage_runtime", "make-tiny-model", str(out), "--kind", "flux"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "demo LoRA adapters" in done.stdout
    return str(out)


def test_the_cli_ships_seeded_demo_adapters_for_a_lora_family_and_none_for_dit(flux_with_demo_loras, tmp_path):
    files = {name: (flux_with_demo_loras + f"/loras/{name}/pytorch_lora_weights.safetensors") for name in
             ("ink", "pixel")}
    data = {name: open(path, "rb").read() for name, path in files.items()}
    assert data["ink"] != data["pixel"] and all(len(d) > 1000 for d in data.values())
    from stage_runtime.models.tiny.lora import write_demo_loras

    again = tmp_path / "again"
    shutil.copytree(flux_with_demo_loras, again, ignore=shutil.ignore_patterns("loras"))
    write_demo_loras(again)
    first, second = (load_file(p) for p in (files["ink"], again / "loras/ink/pytorch_lora_weights.safetensors"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)   # seeded
    # (the bytes may differ: safetensors writes its metadata map in no fixed order)
    dit = subprocess.run([sys.executable, "-m", "stage_runtime", "make-tiny-model", str(tmp_path / "dit"), "--kind",
                          "dit"], capture_output=True, text=True, timeout=300)
    assert dit.returncode == 0 and not (tmp_path / "dit" / "loras").exists()


def test_a_relative_path_is_inside_the_model_folder_and_never_leaves_it(tmp_path):
    assert resolve_path("ink", "loras/ink", str(tmp_path)) == str(tmp_path.resolve() / "loras" / "ink")
    assert resolve_path("abs", "/adapters/x", str(tmp_path)) == "/adapters/x"
    with pytest.raises(LoraLoadError, match=r"'up': relative path '../x' leaves the model folder"):
        resolve_path("up", "../x", str(tmp_path))


@pytest.mark.parametrize("mode", ["request", "step"])
def test_the_demo_adapter_by_relative_path_equals_diffusers_load_lora_weights(flux_with_demo_loras, mode):
    config = load_config({"model": {"path": flux_with_demo_loras}, "device": "cpu", "warmup": False,
                          "loras": [{"name": "ink", "path": "loras/ink"}], "scheduler": {"execution_mode": mode}})
    engine = DiffusionEngine.make_engine(config)
    try:
        sampling = SamplingParams(num_inference_steps=3, seed=11, height=64, width=64, guidance_scale=3.5,
                                  loras=[{"name": "ink", "scale": 1.0}])
        ours = engine.add_request(DiffusionRequest("r", "a photo of a cat", sampling)).result(timeout=120).images
    finally:
        engine.close()
    bare = bare_with_loras(flux_with_demo_loras, {"ink": flux_with_demo_loras + "/loras/ink"}, [1.0],
                           "a photo of a cat", 3, 11, guidance_scale=3.5)
    assert max_diff(ours, bare) <= (1 if mode == "request" else 2)
