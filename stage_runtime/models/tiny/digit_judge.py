"""The digit judge: a small CNN that says which digit an image shows, to score what the digits model draws.

Trained by ``stage-runtime train-tiny`` (stage_runtime.train.judge) on the same training digits as the model,
shipped beside it (``trained/digit-judge.safetensors``). Its score of a set of generated images is the share
classified as the digit each was asked for: a figure a block-cache threshold, a parallel layout or an offload
mode can be held to (docs/trained-model.md). Any image size and RGB: the judge looks at the grey level,
resized to 32x32.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

SIDE = 32
TRAINED = Path(__file__).resolve().parent / "trained"
JUDGE_FILE = TRAINED / "digit-judge.safetensors"


class DigitJudge(nn.Module):
    """Three 3x3 conv + ReLU + 2x2 max-pool levels (16, 32, 64 channels), then a linear layer to 10 logits.
    Input: (N, 1, 32, 32) in [0, 1], 1 = paper."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(64 * (SIDE // 8) ** 2, 10)

    def forward(self, paper: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(1.0 - paper).flatten(1))

    @torch.no_grad()
    def classify(self, images: np.ndarray | torch.Tensor) -> np.ndarray:
        """The digit each image shows: ``images`` uint8 (N, H, W, 3) (or (H, W, 3)), as the engine returns them,
        or float (N, 1, 32, 32) in [0, 1]."""
        return self(as_paper(images)).argmax(dim=1).numpy()

    def score(self, images, digits) -> float:
        """The share of ``images`` classified as the digit each was asked for (``digits``: ints or "0".."9")."""
        asked = np.array([int(d) for d in digits])
        found = self.classify(images)
        if len(found) != len(asked):
            raise ValueError(f"digits: {len(asked)} given for {len(found)} images")
        return float((found == asked).mean())


def as_paper(images: np.ndarray | torch.Tensor) -> torch.Tensor:
    """uint8 RGB (N, H, W, 3) → grey (N, 1, 32, 32) in [0, 1]; a float (N, 1, 32, 32) tensor passes as it is."""
    if isinstance(images, torch.Tensor) and images.is_floating_point():
        return images
    array = np.asarray(images)
    if array.ndim == 3:
        array = array[None]
    grey = torch.from_numpy(array.astype(np.float32)).mean(dim=-1)[:, None] / 255.0
    if grey.shape[-2:] != (SIDE, SIDE):
        grey = F.interpolate(grey, size=(SIDE, SIDE), mode="bilinear", antialias=True, align_corners=False)
    return grey


def load_judge(path: str | Path = JUDGE_FILE) -> DigitJudge:
    """The trained judge (evaluation mode) from its safetensors file."""
    from safetensors.torch import load_file

    judge = DigitJudge()
    judge.load_state_dict(load_file(str(path)))
    return judge.eval()
