"""The digits split and drawing (stage_runtime/train/digits_data.py): stratified, disjoint, seeded, ink on paper."""

from __future__ import annotations

import torch

from stage_runtime.train.digits_data import HELD_OUT, SIZE, draw, raw_digits, split_digits, to_pipeline_pixels


def test_the_split_holds_out_a_fifth_of_every_digit_and_nothing_twice():
    ink, labels = raw_digits()
    split = split_digits(seed=0)
    assert len(split.train_labels) + len(split.test_labels) == len(labels) == 1797
    for digit in range(10):
        total = int((labels == digit).sum())
        assert int((split.test_labels == digit).sum()) == round(total * HELD_OUT)
    assert split.train_images.shape == (len(split.train_labels), 1, SIZE, SIZE)
    # every drawn digit appears once: the held-out images are none of the training images
    train = {tuple(img.flatten().tolist()) for img in split.train_images[:, :, ::4, ::4]}
    assert not any(tuple(img.flatten().tolist()) in train for img in split.test_images[:, :, ::4, ::4])


def test_the_split_is_the_seeds_own():
    a, b, other = split_digits(seed=0), split_digits(seed=0), split_digits(seed=1)
    assert torch.equal(a.test_images, b.test_images) and torch.equal(a.test_labels, b.test_labels)
    assert not torch.equal(a.test_images, other.test_images)


def test_digits_are_dark_ink_on_white_paper_in_the_vae_range():
    ink = torch.zeros(1, 8, 8)
    ink[0, 2:6, 3:5] = 1.0                                   # a bar of full ink
    paper = draw(ink)
    assert paper.shape == (1, 1, SIZE, SIZE) and paper.min() >= 0 and paper.max() <= 1
    assert paper[0, 0, 0, 0] == 1.0 and paper[0, 0, 16, 16] < 0.05      # paper at the corner, ink in the bar
    pixels = to_pipeline_pixels(paper)
    assert pixels.shape == (1, 3, SIZE, SIZE) and pixels[0, :, 0, 0].tolist() == [1.0, 1.0, 1.0]
    assert float(pixels.min()) >= -1.0
