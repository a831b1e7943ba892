"""Quality figures that mean something: the trained tiny digits model and its judge, for the benches.

With random weights an image metric only says how far two outputs are apart. The built-in ``tiny-digits``
model is trained (docs/trained-model.md), so a bench can also ask whether a path still draws the digit it was
asked for: every digit "0".."9", ``per_digit`` images each, scored by the digit judge (the share read as the
digit asked for), next to the PSNR against the reference path's images. A path whose score falls more than
``SCORE_MARGIN`` below the reference's is flagged.
"""

from __future__ import annotations

import math

import numpy as np

DIGITS = tuple(str(d) for d in range(10))
SCORE_MARGIN = 0.05          # a drop of more than 5 points of judge score is flagged


def digits_folder(root: str) -> str:
    """The built-in tiny-digits folder, written under ``root``."""
    from stage_runtime.models.tiny import make_tiny_model

    return str(make_tiny_model(f"{root}/tiny-digits", kind="digits"))


def draw_digits(engine, tag: str, per_digit: int = 4, seed: int = 0, **sampling) -> dict:
    """Every digit at once through ``engine`` (one request each, ``per_digit`` images at seeds seed..): the
    final outputs by digit (``images(...)`` takes their uint8 (per_digit, H, W, 3) images)."""
    from stage_runtime.request import DiffusionRequest, SamplingParams

    streams = {d: engine.add_request(DiffusionRequest(f"{tag}-{d}", d, SamplingParams(
        seed=seed, num_outputs=per_digit, **sampling))) for d in DIGITS}
    return {d: s.result(timeout=600) for d, s in streams.items()}


def images(outputs: dict) -> dict[str, np.ndarray]:
    return {d: out.images for d, out in outputs.items()}


_JUDGE = []


def judge_score(images: dict[str, np.ndarray]) -> float:
    """The share of the images the judge reads as the digit each was asked for."""
    from stage_runtime.models.tiny.digit_judge import load_judge

    if not _JUDGE:
        _JUDGE.append(load_judge())
    found = np.concatenate([_JUDGE[0].classify(images[d]) for d in images])
    return float((found == np.concatenate([[int(d)] * len(images[d]) for d in images])).mean())


def psnr(images: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> float:
    a = np.concatenate([images[d] for d in DIGITS]).astype(float)
    b = np.concatenate([reference[d] for d in DIGITS]).astype(float)
    mse = float(((a - b) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255 ** 2 / mse)


def max_diff(images: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> int:
    return max(int(np.abs(images[d].astype(int) - reference[d].astype(int)).max()) for d in DIGITS)


def quality(images: dict[str, np.ndarray], reference: dict[str, np.ndarray], reference_name: str = "reference") -> str:
    """``judge 92.5% (reference 95.0%, -2.5 points)  PSNR 41.2 dB  max|diff| 3`` and a FLAG past the margin."""
    score, base = judge_score(images), judge_score(reference)
    drop = base - score
    flag = f"  FLAG: the judge score drops {drop * 100:.1f} points (> {SCORE_MARGIN * 100:.0f})" \
        if drop > SCORE_MARGIN else ""
    return (f"judge {score:.1%} ({reference_name} {base:.1%}, {-drop * 100:+.1f} points)  "
            f"PSNR {psnr(images, reference):.1f} dB  max|diff| {max_diff(images, reference)}{flag}")
