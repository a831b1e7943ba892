"""``stage-runtime train-tiny`` at its edge (stage_runtime/train/command.py): bad input refused naming the flag, and
what counts as reproducing the shipped model (the digest, or the judge figures within the margins)."""

from __future__ import annotations

import pytest

from stage_runtime.cli import main
from stage_runtime.train.command import MARGIN, MIN_JUDGE_ACCURACY, reproduction

SHIPPED = {"digits_digest": "a" * 64, "judge_held_out_accuracy": 0.97, "generated_score": 0.9}


@pytest.mark.parametrize(("argv", "named"), [
    (["--seed", "-1"], "--seed=-1: must be >= 0"),
    (["--threads", "0"], "--threads=0: must be >= 1"),
    (["--check"], "out_dir='"),                          # --check never overwrites the shipped folder
])
def test_bad_input_exits_2_naming_the_flag(capsys, argv, named):
    assert main(["train-tiny", *argv]) == 2
    assert named in capsys.readouterr().err


def test_the_same_digest_is_a_bitwise_reproduction():
    ok, why = reproduction({**SHIPPED, "generated_score": 0.1}, SHIPPED)     # the digest alone decides
    assert ok and why.startswith("bitwise")


@pytest.mark.parametrize(("accuracy", "score", "ok"), [
    (0.96, 0.9 - MARGIN + 0.001, True),
    (0.96, 0.9 + MARGIN - 0.001, True),
    (0.96, 0.9 - MARGIN - 0.01, False),                   # the model draws worse than the shipped one
    (MIN_JUDGE_ACCURACY - 0.01, 0.9, False),              # the judge itself is not good enough to say
])
def test_another_digest_reproduces_only_within_the_margins(accuracy, score, ok):
    made = {"digits_digest": "b" * 64, "judge_held_out_accuracy": accuracy, "generated_score": score}
    got, why = reproduction(made, SHIPPED)
    assert got is ok and why.startswith("not bitwise") and "b" * 64 in why
