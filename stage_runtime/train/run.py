"""The whole training of the tiny digits model: data → VAE → DiT → judge → the folder, its digest, the manifest.

Writes, under ``out``:

    digits/                    the DiTPipeline folder (``save_pretrained``, safetensors; ``id2label`` in
                               model_index.json: "0".."9" and "zero".."nine")
    digit-judge.safetensors    the judge's weights
    MANIFEST.json              the command, the recipe, the folder digest, the judge's held-out accuracy, the
                               generated digits' judge score, the training time and the versions

Reproducible for a seed on one machine and thread count (one explicit generator per stage, each model's
initialisation seeded, deterministic algorithms); across CPUs the float sums may round differently, so another
machine gets another digest and a model whose scores are within the margins of docs/trained-model.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

from stage_runtime.models.tiny.digit_judge import DigitJudge
from stage_runtime.train.digits_data import split_digits, to_pipeline_pixels
from stage_runtime.train.dit import digits_scheduler, train_dit
from stage_runtime.train.judge import accuracy, train_judge
from stage_runtime.train.recipe import Recipe
from stage_runtime.train.vae import encode_all, reconstruction_error, train_vae

WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
ID2LABEL = {i: f"{i}, {word}" for i, word in enumerate(WORDS)}
DEFAULT_STEPS, DEFAULT_GUIDANCE = 20, 4.0     # the engine's DiT defaults (models/families/dit.py, adapter.py)


def folder_digest(folder: str | Path) -> str:
    """SHA-256 of the folder's ``sha256sum`` listing (``<hex>  ./<path>`` lines, sorted by path), i.e.
    ``(cd DIR && find . -type f | LC_ALL=C sort | xargs sha256sum) | sha256sum``."""
    root = Path(folder)
    files = sorted(("./" + p.relative_to(root).as_posix(), p) for p in root.rglob("*") if p.is_file())
    listing = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {rel}\n" for rel, p in files)
    return hashlib.sha256(listing.encode()).hexdigest()


def file_digest(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def stage(recipe: Recipe, index: int) -> torch.Generator:
    """Seed the global RNG (the model's initialisation) and return the stage's own generator (its draws)."""
    torch.manual_seed(recipe.seed * 100 + index)
    return torch.Generator().manual_seed(recipe.seed * 100 + index)


@contextlib.contextmanager
def trained_under(recipe: Recipe):
    """The recipe's torch threads and deterministic algorithms, the caller's RNG state kept; all restored after."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(recipe.threads)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def digits_pipeline(dit, vae):
    from diffusers import DiTPipeline

    pipe = DiTPipeline(transformer=dit, vae=vae, scheduler=digits_scheduler(), id2label=ID2LABEL)
    pipe.register_to_config(id2label=ID2LABEL)       # save_pretrained then writes it; from_pretrained passes it
    return pipe


@torch.no_grad()
def generated_score(pipe, judge: DigitJudge, seeds: range) -> float:
    """The judge's score of every digit drawn at each seed, by the bare pipeline at the engine's defaults."""
    found, asked = [], []
    for digit in range(10):
        generators = [torch.Generator("cpu").manual_seed(s) for s in seeds]
        images = pipe(class_labels=[digit] * len(seeds), generator=generators, num_inference_steps=DEFAULT_STEPS,
                      guidance_scale=DEFAULT_GUIDANCE, output_type="np").images
        found.append(judge.classify((images * 255).round().clip(0, 255).astype(np.uint8)))
        asked += [digit] * len(seeds)
    return float((np.concatenate(found) == np.array(asked)).mean())


def train_tiny_digits(out: str | Path, recipe: Recipe = Recipe(), command: str = "", log=print) -> dict:
    """Train everything into ``out``; returns the manifest (also written to ``out/MANIFEST.json``)."""
    from diffusers import __version__ as diffusers_version
    from safetensors.torch import save_file

    out = Path(out)
    with trained_under(recipe):
        started, cpu_started, times = time.perf_counter(), time.process_time(), {}
        split = split_digits(recipe.seed)
        pixels = to_pipeline_pixels(split.train_images)
        log(f"digits: {len(split.train_labels)} for training, {len(split.test_labels)} held out")
        t = time.perf_counter()
        vae = train_vae(pixels, recipe, stage(recipe, 1), log)
        times["vae_s"] = time.perf_counter() - t
        means, stds = encode_all(vae, pixels)
        t = time.perf_counter()
        dit = train_dit(means, stds, split.train_labels, recipe, stage(recipe, 2), log)
        times["dit_s"] = time.perf_counter() - t
        t = time.perf_counter()
        judge = train_judge(split.train_images, split.train_labels, recipe, stage(recipe, 3), log)
        times["judge_s"] = time.perf_counter() - t
        train_seconds, train_cpu = time.perf_counter() - started, time.process_time() - cpu_started
        pipe = digits_pipeline(dit, vae)
        pipe.save_pretrained(out / "digits", safe_serialization=True)
        save_file(judge.state_dict(), str(out / "digit-judge.safetensors"))
        held_out = to_pipeline_pixels(split.test_images)
        figures = {"judge_held_out_accuracy": round(accuracy(judge, split.test_images, split.test_labels), 4),
                   "held_out_digits": len(split.test_labels),
                   "vae_reconstruction_error": round(reconstruction_error(vae, held_out), 4),
                   "generated_score": round(generated_score(pipe, judge, range(recipe.score_seeds)), 4),
                   "generated_score_images": 10 * recipe.score_seeds}
    manifest = {
        "command": command, "recipe": recipe.as_dict(),
        "digits_digest": folder_digest(out / "digits"),
        "digits_bytes": sum(p.stat().st_size for p in (out / "digits").rglob("*") if p.is_file()),
        "judge_digest": file_digest(out / "digit-judge.safetensors"), **figures,
        "train_seconds": round(train_seconds, 1), "train_cpu_seconds": round(train_cpu, 1),
        "stage_seconds": {k: round(v, 1) for k, v in times.items()},
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "torch": torch.__version__,
        "diffusers": diffusers_version,
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
