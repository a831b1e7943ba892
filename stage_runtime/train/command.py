"""``stage-runtime train-tiny [OUT_DIR] [--seed N] [--threads N] [--check]`` (``make train-tiny``).

Trains the tiny digits model and its judge on CPU (stage_runtime.train.run) into OUT_DIR (default: the shipped
folder, ``stage_runtime/models/tiny/trained``) and prints the manifest. ``--check`` compares the result with
the shipped manifest: the same folder digest (bitwise reproduced), or, where the machine rounds differently,
a judge held-out accuracy of at least 95 % and a generated score within ``MARGIN`` of the shipped one; exit 1
when neither holds. Exit 2 for bad input (a negative seed, no thread, scikit-learn missing).
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from stage_runtime.errors import ConfigError

MARGIN = 0.05                 # generated score: a retrain elsewhere may differ by this much (docs/trained-model.md)
MIN_JUDGE_ACCURACY = 0.95


def shipped_folder() -> Path:
    from stage_runtime.models.tiny.digit_judge import TRAINED

    return TRAINED


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-tiny", help="train the tiny digits DiT and its judge on CPU (docs/trained-model.md)")
    p.add_argument("out_dir", nargs="?", help="where digits/, digit-judge.safetensors and MANIFEST.json go "
                                              "(default: the shipped folder, stage_runtime/models/tiny/trained)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the shipped model: 1)")
    p.add_argument("--check", action="store_true", help="compare with the shipped manifest: the digest, or the "
                                                        "judge figures within the stated margins; exit 1 if neither")
    p.set_defaults(func=run)


def reproduction(made: dict, shipped: dict) -> tuple[bool, str]:
    """Whether ``made`` reproduces ``shipped``: bitwise (same digest), or within the margins; and why."""
    if made["digits_digest"] == shipped["digits_digest"]:
        return True, f"bitwise: digest {made['digits_digest']} as shipped"
    accuracy, score, want = made["judge_held_out_accuracy"], made["generated_score"], shipped["generated_score"]
    ok = accuracy >= MIN_JUDGE_ACCURACY and abs(score - want) <= MARGIN
    return ok, (f"not bitwise (digest {made['digits_digest']}, shipped {shipped['digits_digest']}); judge held-out "
                f"accuracy {accuracy:.3f} (>= {MIN_JUDGE_ACCURACY}: {accuracy >= MIN_JUDGE_ACCURACY}), generated "
                f"score {score:.3f} vs shipped {want:.3f} (within {MARGIN}: {abs(score - want) <= MARGIN})")


def run(args: argparse.Namespace) -> int:
    from stage_runtime.train.recipe import Recipe
    from stage_runtime.train.run import train_tiny_digits

    if args.seed < 0:
        raise ConfigError(f"--seed={args.seed}: must be >= 0")
    if args.threads < 1:
        raise ConfigError(f"--threads={args.threads}: must be >= 1")
    shipped = shipped_folder()
    out = Path(args.out_dir) if args.out_dir else shipped
    if args.check and out.resolve() == shipped.resolve():
        raise ConfigError(f"out_dir={str(out)!r}: --check trains elsewhere and compares with the shipped folder")
    expected = json.loads((shipped / "MANIFEST.json").read_text()) if args.check else None
    if expected is not None:
        for flag, value in (("seed", args.seed), ("threads", args.threads)):
            if expected["recipe"][flag] != value:
                raise ConfigError(f"--{flag}={value}: --check retrains the shipped recipe, which has "
                                  f"--{flag} {expected['recipe'][flag]}")
    command = "stage-runtime train-tiny" + (f" {shlex.quote(str(args.out_dir))}" if args.out_dir else "") + \
        f" --seed {args.seed} --threads {args.threads}"
    manifest = train_tiny_digits(out, Recipe(seed=args.seed, threads=args.threads), command=command)
    print(json.dumps(manifest, indent=2))
    if expected is None:
        return 0
    ok, why = reproduction(manifest, expected)
    print(("reproduced " if ok else "NOT reproduced: ") + why)
    return 0 if ok else 1
