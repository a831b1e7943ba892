"""The shipped digit judge (stage_runtime/models/tiny/digit_judge.py): it reads held-out real digits at 95 % or more,
it is the judge the manifest describes, and it takes the engine's uint8 images of any size."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from stage_runtime.models.tiny.digit_judge import JUDGE_FILE, TRAINED, as_paper, load_judge
from stage_runtime.train.digits_data import split_digits
from stage_runtime.train.run import file_digest

torch.set_num_threads(1)
MANIFEST = json.loads((TRAINED / "MANIFEST.json").read_text())


@pytest.fixture(scope="module")
def judge():
    return load_judge()


@pytest.fixture(scope="module")
def held_out():
    split = split_digits(MANIFEST["recipe"]["seed"])
    return split.test_images, split.test_labels


def test_the_judge_reads_held_out_real_digits_at_95_percent_or_more(judge, held_out):
    images, labels = held_out
    accuracy = float((torch.from_numpy(judge.classify(images)) == labels).float().mean())
    assert accuracy >= 0.95, accuracy
    assert round(accuracy, 4) == MANIFEST["judge_held_out_accuracy"]       # the manifest's figure is this judge's
    assert file_digest(JUDGE_FILE) == MANIFEST["judge_digest"]


def test_uint8_rgb_images_read_as_their_grey_level_at_any_size(judge, held_out):
    images, labels = held_out
    rgb = (images[:40, 0, :, :, None].expand(-1, -1, -1, 3) * 255).round().to(torch.uint8).numpy()
    assert np.array_equal(judge.classify(rgb), judge.classify(images[:40]))      # uint8 rounding changes no answer
    big = rgb.repeat(2, axis=1).repeat(2, axis=2)                               # 64x64: resized to 32x32
    assert as_paper(big).shape == (40, 1, 32, 32)
    assert (judge.classify(big) == labels[:40].numpy()).mean() >= 0.9
    assert judge.classify(rgb[0]).shape == (1,)                                  # one (H, W, 3) image
    assert judge.score(rgb[:10], [str(int(d)) for d in labels[:10]]) == float(
        (judge.classify(rgb[:10]) == labels[:10].numpy()).mean())


def test_a_score_needs_one_digit_per_image(judge, held_out):
    with pytest.raises(ValueError, match="digits: 3 given for 2 images"):
        judge.score(held_out[0][:2], [1, 2, 3])
