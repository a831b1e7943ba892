"""The training data: scikit-learn's handwritten digits, split once, drawn at 32x32.

``load_digits`` ships 1,797 digits of 8x8 pixels in 17 grey levels (0 = paper, 16 = ink) inside the package.
A seeded, stratified split holds out a fifth of each digit: no model of the recipe trains on them, so the
judge's held-out accuracy is measured on digits nobody has seen. The images are upscaled bicubically to
32x32 and drawn as dark ink on white paper, in [0, 1] (1 = paper).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stage_runtime.errors import ConfigError

SIZE = 32                 # the drawn side, in pixels (the pipeline's image size)
HELD_OUT = 0.2            # the share of each digit held out
NATIVE = 8                # load_digits' side
GREY_LEVELS = 16          # load_digits' ink scale (0..16)


@dataclass(frozen=True)
class DigitSplit:
    train_images: torch.Tensor        # (N, 1, SIZE, SIZE) float32 in [0, 1], 1 = paper
    train_labels: torch.Tensor        # (N,) int64, 0..9
    test_images: torch.Tensor
    test_labels: torch.Tensor


def raw_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """(1797, 8, 8) ink in [0, 1] and (1797,) labels, from scikit-learn; a clear error where it is missing."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ConfigError("train-tiny needs scikit-learn (its load_digits data set): pip install "
                          "'diffstage[train]'") from None
    data = load_digits()
    return (torch.tensor(data.images, dtype=torch.float32) / GREY_LEVELS,
            torch.tensor(data.target, dtype=torch.int64))


def draw(ink: torch.Tensor, size: int = SIZE) -> torch.Tensor:
    """(N, 8, 8) ink in [0, 1] → (N, 1, size, size) dark ink on white paper in [0, 1]."""
    up = F.interpolate(ink[:, None], size=(size, size), mode="bicubic", align_corners=False)
    return 1.0 - up.clamp(0.0, 1.0)


def split_digits(seed: int, size: int = SIZE) -> DigitSplit:
    """The stratified split of ``load_digits`` for ``seed``: per digit, a seeded permutation, its first fifth held
    out. Same seed → the same split on every machine (integer work only)."""
    ink, labels = raw_digits()
    generator = torch.Generator().manual_seed(seed)
    held = torch.zeros(len(labels), dtype=torch.bool)
    for digit in range(10):
        members = torch.nonzero(labels == digit).flatten()
        order = members[torch.randperm(len(members), generator=generator)]
        held[order[:round(len(members) * HELD_OUT)]] = True
    images = draw(ink, size)
    return DigitSplit(images[~held], labels[~held], images[held], labels[held])


def to_pipeline_pixels(images: torch.Tensor) -> torch.Tensor:
    """(N, 1, H, W) in [0, 1] → (N, 3, H, W) in [-1, 1]: the RGB range a diffusers VAE works in."""
    return (images * 2.0 - 1.0).expand(-1, 3, -1, -1).contiguous()
