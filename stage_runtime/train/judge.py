"""Training the digit judge (stage_runtime.models.tiny.digit_judge) on the training digits.

Adam over shuffled epochs, every batch shifted by up to ``judge_shift`` pixels (the digits model does not
centre its digits exactly as the data set does) with a seeded generator. Its accuracy on the held-out digits
is the figure the manifest and the tests quote.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stage_runtime.models.tiny.digit_judge import DigitJudge


def shifted(images: torch.Tensor, most: int, generator: torch.Generator) -> torch.Tensor:
    """Each image moved by a seeded random (dy, dx) in [-most, most], the border filled with paper."""
    if most == 0:
        return images
    n, _, h, w = images.shape
    padded = F.pad(images, (most, most, most, most), value=1.0)
    dy = torch.randint(0, 2 * most + 1, (n,), generator=generator)
    dx = torch.randint(0, 2 * most + 1, (n,), generator=generator)
    return torch.stack([padded[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(n)])


def train_judge(images: torch.Tensor, labels: torch.Tensor, recipe, generator: torch.Generator,
                log=print) -> DigitJudge:
    """(N, 1, 32, 32) paper-white images and their labels → the trained judge (evaluation mode)."""
    judge = DigitJudge()
    opt = torch.optim.Adam(judge.parameters(), lr=recipe.judge_lr)
    for epoch in range(recipe.judge_epochs):
        judge.train()
        order, total = torch.randperm(len(images), generator=generator), 0.0
        for at in range(0, len(images), recipe.judge_batch):
            idx = order[at:at + recipe.judge_batch]
            loss = F.cross_entropy(judge(shifted(images[idx], recipe.judge_shift, generator)), labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        if epoch % 5 == 4 or epoch == recipe.judge_epochs - 1:
            log(f"judge epoch {epoch + 1:3d}/{recipe.judge_epochs}  loss {total / len(images):.4f}")
    return judge.eval()


@torch.no_grad()
def accuracy(judge: DigitJudge, images: torch.Tensor, labels: torch.Tensor) -> float:
    return float((judge(images).argmax(dim=1) == labels).float().mean())
