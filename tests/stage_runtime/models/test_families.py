"""The model-family checklist, run over the registry (stage_runtime.model_catalog reads it from the adapters).

Every family has all of its pieces — a tiny builder, a CRD ``builtin``, a row in docs/model-families.md that
says what its adapter says, a test module with its ``FAMILY`` row — and passes the shared checks through the
real engine: equal to the bare diffusers call in request mode and (where it declares step mode) in step mode,
abort at a random step releases everything, progress in order. Adding a family is one adapter module, one
tiny builder and one test module; this file then holds it to all of the above.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest
import torch
import yaml
from family_checks import (Family, check_abort_next_to_a_batch_mate, check_progress_with_previews,
                           check_request_mode, check_step_mode)

from stage_runtime import model_catalog
from stage_runtime.models import registry

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[3]
TESTS = Path(__file__).resolve().parent
DOC_HEADER = ("Pipeline class", "Tiny kind", "Adapter", "Guidance", "Step mode", "Parallel", "Edits", "LoRA")


def module_name(family: model_catalog.Family) -> str:
    return family.adapter.split(":")[0].rsplit(".", 1)[1]


def adapter_class(family: model_catalog.Family) -> type:
    module, name = family.adapter.split(":")
    return getattr(importlib.import_module(module), name)


def family_rows(family: model_catalog.Family, tests_dir: Path = TESTS) -> tuple[Family, ...]:
    """The rows its test module declares: ``FAMILY``, or ``FAMILIES`` for an adapter of several tiny kinds."""
    path = tests_dir / f"test_{module_name(family)}.py"
    if not path.is_file():
        return ()
    spec = importlib.util.spec_from_file_location(f"family_row_{module_name(family)}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, "FAMILIES", (getattr(module, "FAMILY", None),) if hasattr(module, "FAMILY") else ())


def doc_rows(doc: Path) -> dict[str, dict[str, str]]:
    """docs/model-families.md's family table: pipeline class → its cells by column name."""
    rows: dict[str, dict[str, str]] = {}
    header = None
    for line in doc.read_text().splitlines():
        cells = tuple(c.strip() for c in line.strip().strip("|").split("|")) if line.startswith("|") else None
        if cells is None:
            header = None
        elif cells == DOC_HEADER:
            header = cells
        elif header and not set(cells[0]) <= set("-: "):
            rows[cells[0].strip("`")] = dict(zip(header, cells, strict=True))
    return rows


def crd_builtins(crd: Path) -> set[str]:
    schema = yaml.safe_load(crd.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return set(schema["properties"]["spec"]["properties"]["model"]["properties"]["builtin"]["enum"])


def doc_facts(cls: type, family: model_catalog.Family) -> dict[str, str]:
    """What the docs row must say, from the adapter class's attributes."""
    return {"Tiny kind": ", ".join(f"`{kind}`" for kind in family.tiny_kinds) or "—",
            "Adapter": f"`models/families/{module_name(family)}.py`",
            "Guidance": cls.guidance, "Step mode": "yes" if cls.supports_step_execution else "no",
            "Parallel": ", ".join(sorted(cls.parallel_kinds)) or "—", "LoRA": "yes" if cls.lora_components else "no"}


def checklist_problems(families, root: Path = ROOT, tests_dir: Path = TESTS, classes=adapter_class) -> list[str]:
    """Every missing or disagreeing piece of every family, as sentences (empty: the checklist holds)."""
    problems = []
    builtins = crd_builtins(root / "crds" / "diffusionstage.yaml")
    docs = doc_rows(root / "docs" / "model-families.md")
    for family in families:
        cls, name = classes(family), family.adapter
        if not family.tiny_kinds:
            problems.append(f"{name}: no tiny_kinds (a family ships a tiny builder)")
        for kind in family.tiny_kinds:
            builder = root / "stage_runtime" / "models" / "tiny" / f"{kind.replace('-', '_')}.py"
            if not builder.is_file() or "build" not in {
                    n.name for n in ast.parse(builder.read_text()).body if isinstance(n, ast.FunctionDef)}:
                problems.append(f"{name}: tiny kind {kind!r} has no build(seed) in {builder.relative_to(root)}")
            if f"tiny-{kind}" not in builtins:
                problems.append(f"{name}: the CRD has no builtin tiny-{kind} (make crds)")
        rows = {row.kind for row in family_rows(family, tests_dir)}
        for kind in family.tiny_kinds:
            if kind not in rows:
                problems.append(f"{name}: tests/…/models/test_{module_name(family)}.py declares no FAMILY row of "
                                f"kind {kind!r}")
        for pipeline in family.pipeline_classes:
            cells = docs.get(pipeline)
            if cells is None:
                problems.append(f"{name}: docs/model-families.md has no row for `{pipeline}`")
                continue
            for column, want in doc_facts(cls, family).items():
                if cells[column] != want:
                    problems.append(f"{name}: docs/model-families.md `{pipeline}` says {column}={cells[column]!r}, "
                                    f"the adapter {want!r}")
    return problems


FAMILIES = model_catalog.families()


def test_the_registry_is_the_adapters_own_declarations():
    for family in FAMILIES:
        cls = adapter_class(family)
        assert cls.pipeline_classes == family.pipeline_classes and cls.tiny_kinds == family.tiny_kinds
        for pipeline in family.pipeline_classes:
            assert registry.ADAPTERS[pipeline] == family.adapter
    assert len(registry.ADAPTERS) == sum(len(f.pipeline_classes) for f in FAMILIES) >= 7


def test_every_family_has_all_of_its_pieces():
    assert checklist_problems(FAMILIES) == []
    assert crd_builtins(ROOT / "crds" / "diffusionstage.yaml") == {f"tiny-{k}" for k in model_catalog.tiny_kinds()}
    assert "make-tiny-model /opt/diffstage/models --all" in (ROOT / "images" / "runtime" / "Dockerfile").read_text()


def test_the_checklist_names_each_missing_piece(tmp_path):
    """A family module added alone (no tiny builder, no CRD builtin, no docs row, no test module) fails the
    checklist once per missing piece; a docs row that disagrees with its adapter fails too."""
    (tmp_path / "newfamily.py").write_text("class NewAdapter:\n    pipeline_classes = ('NewPipeline',)\n"
                                           "    tiny_kinds = ('newfamily',)\n")
    (new_family,) = model_catalog.read_families(tmp_path)
    fake = type("NewAdapter", (), {"guidance": "cfg", "supports_step_execution": True,
                                   "parallel_kinds": frozenset({"cfg"}), "lora_components": ()})
    problems = checklist_problems([new_family], classes=lambda _: fake)
    new = "stage_runtime.models.families.newfamily:NewAdapter"
    assert problems == [
        f"{new}: tiny kind 'newfamily' has no build(seed) in stage_runtime/models/tiny/newfamily.py",
        f"{new}: the CRD has no builtin tiny-newfamily (make crds)",
        f"{new}: tests/…/models/test_newfamily.py declares no FAMILY row of kind 'newfamily'",
        f"{new}: docs/model-families.md has no row for `NewPipeline`"]
    (sd,) = [f for f in FAMILIES if "StableDiffusionPipeline" in f.pipeline_classes]
    lying = type("Lying", (adapter_class(sd),), {"parallel_kinds": frozenset({"cfg", "ulysses", "tp"})})
    assert checklist_problems([sd], classes=lambda _: lying) == [
        "stage_runtime.models.families.sd:StableDiffusionAdapter: docs/model-families.md `StableDiffusionPipeline` says "
        "Parallel='cfg, ulysses', the adapter 'cfg, tp, ulysses'"]


def test_two_adapters_cannot_claim_one_pipeline_class(tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"{name}.py").write_text(f"class {name.upper()}:\n    pipeline_classes = ('XPipeline',)\n")
    with pytest.raises(ValueError, match="XPipeline is declared by both .*a:A and .*b:B"):
        model_catalog.read_families(tmp_path)


# -- the shared checks, through the real engine, for every family ----------------------------------------------
CHECKS = {"request_mode_equals_diffusers": (check_request_mode, False),
          "step_mode_equals_diffusers_and_shares_ticks": (check_step_mode, True),
          "abort_at_a_random_step_releases_everything": (check_abort_next_to_a_batch_mate, True),
          "progress_in_order_with_previews": (check_progress_with_previews, True)}


ROWS = [(family, row) for family in FAMILIES for row in family_rows(family)]


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize(("family", "row"), ROWS, ids=[row.name for _, row in ROWS])
def test_family(family, row, check, tiny_model):
    run, needs_step_mode = CHECKS[check]
    if needs_step_mode and not adapter_class(family).supports_step_execution:
        pytest.skip(f"{family.adapter} declares no step mode")
    run(row, tiny_model(row.kind))
