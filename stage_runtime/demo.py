"""``make demo-engine``: the engine alone, in this process, draws the ten digits with the trained tiny model.

Builds the built-in ``tiny-digits`` folder (the trained DiT, shipped in the package: nothing trains, nothing is
downloaded), starts an engine on it, asks for each digit ("0".."9", ``--per-digit`` images each, the model's
default steps and guidance), writes the grid PNG (a row per seed, a column per digit) and prints the judge's
score: the share of the images the digit classifier reads as the digit asked for.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from stage_runtime.cli import main as cli_main

DEMO_DIR = Path(".demo")
DIGITS = tuple(str(d) for d in range(10))


def digit_grid(images: dict[str, np.ndarray], scale: int = 3, gutter: int = 2) -> np.ndarray:
    """uint8 (rows, H, W, 3) per digit → one uint8 picture: a column per digit in order, a row per image,
    each image enlarged ``scale`` times (nearest) and separated by ``gutter`` pixels of grey."""
    columns = [images[d] for d in DIGITS if d in images]
    rows, h, w = columns[0].shape[:3]
    cell_h, cell_w = h * scale + gutter, w * scale + gutter
    grid = np.full((rows * cell_h + gutter, len(columns) * cell_w + gutter, 3), 160, dtype=np.uint8)
    for c, column in enumerate(columns):
        for r, image in enumerate(column):
            big = image.repeat(scale, axis=0).repeat(scale, axis=1)
            grid[gutter + r * cell_h:gutter + r * cell_h + h * scale,
                 gutter + c * cell_w:gutter + c * cell_w + w * scale] = big
    return grid


def judge_line(images: dict[str, np.ndarray]) -> str:
    """The judge's score of the images by the digit each was asked for, as one line."""
    from stage_runtime.models.tiny.digit_judge import load_judge

    judge = load_judge()
    found = {d: judge.classify(images[d]) for d in images}
    right = sum(int((found[d] == int(d)).sum()) for d in images)
    total = sum(len(found[d]) for d in images)
    wrong = ", ".join(f"{d}→{'/'.join(str(x) for x in found[d] if x != int(d))}" for d in images
                      if (found[d] != int(d)).any())
    misread = f"; misread: {wrong}" if wrong else ""
    return f"judge score {right / total:.1%} ({right}/{total} read as the digit asked for{misread})"


def build_model(folder: Path) -> int:
    if (folder / "model_index.json").is_file():
        return 0
    return cli_main(["make-tiny-model", str(folder), "--kind", "digits"])


def run(out: Path, per_digit: int, seed: int) -> int:
    from stage_runtime.config import load_config
    from stage_runtime.engine import DiffusionEngine
    from stage_runtime.imageio import encode_png

    model = DEMO_DIR / "tiny-digits"
    if rc := build_model(model):
        return rc
    engine = DiffusionEngine.make_engine(load_config({"model": {"path": str(model)}, "device": "cpu"}))
    try:
        info = engine.model_info
        print(f"engine up: {info.pipeline_class}, {info.default_width}x{info.default_height}, "
              f"{info.default_steps} steps, guidance {info.default_guidance:g}; drawing {per_digit} of each digit")
        images = {d: engine.generate(d, seed=seed, num_outputs=per_digit, timeout=300).images for d in DIGITS}
    finally:
        engine.close()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(encode_png(digit_grid(images)))
    print(judge_line(images))
    print(f"grid: {out.resolve()} (a column per digit 0..9, a row per seed {seed}..{seed + per_digit - 1})")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stage_runtime.demo", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEMO_DIR / "digits.png")
    p.add_argument("--per-digit", type=int, default=4, help="images of each digit (rows of the grid)")
    p.add_argument("--seed", type=int, default=0, help="the first row's seed (the next rows: seed+1, …)")
    args = p.parse_args(argv)
    if not 1 <= args.per_digit <= 16:
        print(f"error: --per-digit={args.per_digit}: must be 1..16", file=sys.stderr)
        return 2
    return run(args.out, args.per_digit, args.seed)


if __name__ == "__main__":
    sys.exit(main())
