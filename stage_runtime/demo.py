"""``make demo``: build the tiny built-in model if needed and generate one PNG through the engine."""

from __future__ import annotations

import sys
from pathlib import Path

from stage_runtime.cli import main

DEMO_DIR = Path(".demo")


def run() -> int:
    model = DEMO_DIR / "tiny-sd"
    if not (model / "model_index.json").is_file():
        rc = main(["make-tiny-model", str(model), "--kind", "sd"])
        if rc:
            return rc
    return main(["generate", "--model", str(model), "--prompt", "a watercolor lighthouse at dusk",
                 "--steps", "10", "--size", "64x64", "--seed", "7", "--out", str(DEMO_DIR / "demo.png")])


if __name__ == "__main__":
    sys.exit(run())
