"""``make demo-engine``'s pieces (stage_runtime/demo.py): the grid puts each digit in its column, each seed in its row;
the judge's line counts what it reads as asked and names what it misreads. (The engine run itself:
models/test_tiny_digits.py draws through the engine at the same defaults.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stage_runtime.demo import DIGITS, digit_grid, judge_line, main
from stage_runtime.models.tiny.digit_judge import load_judge
from stage_runtime.train.digits_data import split_digits

torch.set_num_threads(1)


def test_the_grid_has_a_column_per_digit_and_a_row_per_image():
    images = {d: np.full((3, 4, 5, 3), 10 * int(d), dtype=np.uint8) for d in DIGITS}
    grid = digit_grid(images, scale=2, gutter=1)
    assert grid.shape == (1 + 3 * (8 + 1), 1 + 10 * (10 + 1), 3)
    for column, d in enumerate(DIGITS):
        for row in range(3):
            top, left = 1 + row * 9, 1 + column * 11
            assert (grid[top:top + 8, left:left + 10] == 10 * int(d)).all()
    assert (grid[0] == 160).all()                                       # the grey gutter


def test_the_judge_line_counts_right_reads_and_names_misreads():
    split = split_digits(0)
    real = {d: (split.test_images[split.test_labels == int(d)][:2, 0, :, :, None].expand(-1, -1, -1, 3) * 255)
            .round().to(torch.uint8).numpy() for d in DIGITS}
    judge = load_judge()
    right = sum(int((judge.classify(real[d]) == int(d)).sum()) for d in DIGITS)
    assert right >= 19                                                # held-out real digits: the judge reads them
    assert judge_line(real).startswith(f"judge score {right / 20:.1%} ({right}/20 read as the digit asked for")
    eights = real["8"][judge.classify(real["8"]) == 8][:1]
    swapped = {**real, "3": np.concatenate([eights, eights])}         # two 8s asked for as 3
    line = judge_line(swapped)
    assert "misread: 3→8/8" in line and "/20 read" in line


@pytest.mark.parametrize("per_digit", ["0", "17"])
def test_per_digit_out_of_range_exits_2(capsys, per_digit):
    assert main(["--per-digit", per_digit]) == 2
    assert f"--per-digit={per_digit}: must be 1..16" in capsys.readouterr().err
