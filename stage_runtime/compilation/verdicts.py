"""``compile.mode: auto``: the mode measured faster for this family on this kind of device, else eager.

The measurements ship with the runtime in ``verdicts.json``, written by ``bench/compile.py --write-verdicts`` (one
row per family and device kind: the mode chosen, the per-step ratios it was chosen on, where and when it ran). A
family with no row for the device, or whose every compiled mode measured slower than eager, runs eagerly: ``auto``
never guesses, and ``/v1/stats`` says which row decided (``compile.auto``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

VERDICTS = Path(__file__).with_name("verdicts.json")


@functools.cache
def load_verdicts() -> dict:
    return json.loads(VERDICTS.read_text(encoding="utf-8"))


def resolve_auto(family: str, device_type: str) -> tuple[str, str]:
    """(the mode auto runs, why) for the pipeline class ``family`` on ``device_type`` ("cpu", "cuda")."""
    row = load_verdicts().get(device_type, {}).get(family)
    if row is None:
        return "none", (f"no compile measurement of {family} on {device_type} (bench/compile.py --write-verdicts on "
                        "such a device adds one; or set compile.mode regional or full): eager")
    ratios = ", ".join(f"{mode} {ratio:g}x" for mode, ratio in sorted(row.get("ratios", {}).items()))
    return row["mode"], (f"{family} on {device_type}: {row['mode']} (measured per step vs eager: {ratios}; "
                         f"{row['source']})")
