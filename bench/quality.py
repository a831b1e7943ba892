"""Quality through every serving path: the trained tiny digits model's ten digits, judged, path by path.

With random weights "equal within 2 (uint8)" compares noise with noise. The built-in ``tiny-digits`` model is
trained (docs/trained-model.md), so each path is also held to what it draws: every digit "0".."9",
``--per-digit`` images each (seeds 0..), at the model's defaults (20 steps, guidance 4), scored by the digit
judge (the share read as the digit asked for) against the reference path, with the PSNR and the largest
|diff| (uint8) against the reference's images (bench/digit_quality.py):

    reference        request mode, uni executor, one rank
    step mode        max_num_seqs 4: the ten requests share denoising ticks
    previews         step mode, a preview every 5 steps: each preview's score and PSNR against the final image
    cfg / ulysses / ring / tp = 2     the mp executor, 2 rank processes (gloo)
    offload model / layerwise         weights brought in per phase / per block

A path whose score falls more than 5 points below the reference's is flagged. The images of a path are the
same every run (fixed seeds); ``--runs`` repeats them and reports the score's min–max (0 spread expected).

    .venv/bin/python bench/quality.py [--per-digit 4] [--runs 1] [--threads 1] [--paths step,cfg,...]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digit_quality import DIGITS, digits_folder, draw_digits, images, judge_score, psnr, quality  # noqa: E402
from stats import machine  # noqa: E402

PATHS = {
    "step mode": {"scheduler": {"execution_mode": "step", "max_num_seqs": 4}},
    "cfg_parallel_size=2": {"executor": "mp", "parallel": {"cfg_parallel_size": 2}},
    "ulysses_degree=2": {"executor": "mp", "parallel": {"ulysses_degree": 2}},
    "ring_degree=2": {"executor": "mp", "parallel": {"ring_degree": 2}},
    "tensor_parallel_size=2": {"executor": "mp", "parallel": {"tensor_parallel_size": 2}},
    "offload model": {"offload": {"mode": "model"}},
    "offload layerwise": {"offload": {"mode": "layerwise"}},
}
SHORT = {"step": "step mode", "cfg": "cfg_parallel_size=2", "ulysses": "ulysses_degree=2", "ring": "ring_degree=2",
         "tp": "tensor_parallel_size=2", "offload": "offload model", "layerwise": "offload layerwise"}
PREVIEW_EVERY = 5


def engine(path: str, **config):
    from stage_runtime.config import load_config
    from stage_runtime.engine import DiffusionEngine

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                     # tp without ulysses warns
        return DiffusionEngine.make_engine(load_config({"model": {"path": path}, "device": "cpu", **config}))


def drawn(path: str, runs: int, per_digit: int, **config) -> list[dict]:
    eng = engine(path, **config)
    try:
        return [images(draw_digits(eng, f"r{run}", per_digit)) for run in range(runs)]
    finally:
        eng.close()


def previews(path: str, per_digit: int) -> tuple[dict[int, dict], dict]:
    """Step mode with a preview every PREVIEW_EVERY steps: the previews by step and the finals, by digit."""
    from stage_runtime.request import DiffusionRequest, SamplingParams

    eng = engine(path, scheduler={"execution_mode": "step", "max_num_seqs": 4, "streaming_output": True})
    by_step: dict[int, dict] = {}
    final: dict = {}
    try:
        streams = {d: eng.add_request(DiffusionRequest(f"p-{d}", d, SamplingParams(
            seed=0, num_outputs=per_digit, stream=True, preview_every=PREVIEW_EVERY))) for d in DIGITS}
        for d, stream in streams.items():
            for item in stream:
                if item.finished:
                    final[d] = item.images
                elif item.images is not None:
                    by_step.setdefault(item.step_index, {})[d] = item.images
    finally:
        eng.close()
    return by_step, final


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--per-digit", type=int, default=4)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--paths", default=",".join(SHORT), help=f"which paths besides the reference: {', '.join(SHORT)}")
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)           # inherited by the mp ranks
    import torch

    torch.set_num_threads(args.threads)
    unknown = [name for name in args.paths.split(",") if name and name not in SHORT]
    if unknown:
        p.error(f"--paths: unknown {unknown}; known: {', '.join(SHORT)}")
    print(f"machine: {machine()}; torch threads {args.threads}")
    with tempfile.TemporaryDirectory(prefix="bench-quality-") as root:
        path = digits_folder(root)
        reference = drawn(path, args.runs, args.per_digit)
        base = reference[-1]
        scores = [judge_score(r) for r in reference]
        print(f"\n== trained tiny digits DiT, the 10 digits x {args.per_digit} images, 20 steps, guidance 4, "
              f"{args.runs} run(s) per path")
        print(f"  {'reference':<24} judge {scores[-1]:.1%} (min {min(scores):.1%} – max {max(scores):.1%} over runs)")
        for short in (s for s in args.paths.split(",") if s):
            name = SHORT[short]
            runs = drawn(path, args.runs, args.per_digit, **PATHS[name])
            spread = [judge_score(r) for r in runs]
            print(f"  {name:<24} {quality(runs[-1], base, 'reference')}  (score min {min(spread):.1%} – "
                  f"max {max(spread):.1%})")
        by_step, final = previews(path, args.per_digit)
        print(f"\n== previews (step mode, preview_every {PREVIEW_EVERY}): each against the final image")
        for step in sorted(by_step):
            print(f"  after step {step:>2}  judge {judge_score(by_step[step]):.1%}  "
                  f"PSNR vs final {psnr(by_step[step], final):.1f} dB")
        print(f"  final           {quality(final, base, 'reference')}")


if __name__ == "__main__":
    main()
