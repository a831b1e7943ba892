"""``compile.mode: auto`` follows the shipped measurements (compilation/verdicts.json, written by bench/compile.py):
a family measured faster compiled gets that mode with the measurement named; anything unmeasured runs eagerly."""

from __future__ import annotations

from stage_runtime.compilation.verdicts import load_verdicts, resolve_auto


def test_every_shipped_row_names_a_compiled_mode_or_eager_and_its_source():
    for device, rows in load_verdicts().items():
        assert device in ("cpu", "cuda")
        for family, row in rows.items():
            assert row["mode"] in ("none", "regional", "full") and row["source"], (device, family)
            mode, why = resolve_auto(family, device)
            assert mode == row["mode"] and why.startswith(f"{family} on {device}: {mode}")


def test_an_unmeasured_family_runs_eagerly_saying_so():
    mode, why = resolve_auto("NoSuchPipeline", "cuda")
    assert mode == "none"
    assert why.startswith("no compile measurement of NoSuchPipeline on cuda (bench/compile.py --write-verdicts")
