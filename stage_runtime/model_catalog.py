"""The model families, read from the adapter modules without importing them.

A family is one adapter module in ``stage_runtime/models/families/``. Its adapter class says, in its own body, which
diffusers pipeline classes it serves and which tiny kinds build one::

    class StableDiffusionAdapter(...):
        pipeline_classes = ("StableDiffusionPipeline",)
        tiny_kinds = ("sd",)

This module reads those two literals with ``ast`` (torch-free: the operator and the engine process use it
too), so the registry (``model.path`` → adapter), ``make-tiny-model --kind``, the CRD's ``builtin`` enum and
the runtime image's prebuilt models all follow from the adapters: adding a family adds no line anywhere else.
A tiny kind ``k`` is built by ``stage_runtime/models/tiny/<k with - as _>.py`` (its ``build(seed)``).
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent / "models"
FAMILIES_DIR = MODELS_DIR / "families"
FAMILIES_PACKAGE = "stage_runtime.models.families"
FACT_NAMES = ("pipeline_classes", "tiny_kinds")


@dataclass(frozen=True)
class Family:
    adapter: str                         # "stage_runtime.models.families.sd:StableDiffusionAdapter"
    pipeline_classes: tuple[str, ...]    # model_index.json ``_class_name`` values it serves
    tiny_kinds: tuple[str, ...]          # make-tiny-model kinds that build one of them

    @property
    def module_path(self) -> Path:
        return FAMILIES_DIR / (self.adapter.split(":")[0].rsplit(".", 1)[1] + ".py")


def class_facts(node: ast.ClassDef, where: str) -> dict[str, tuple[str, ...]]:
    """The family literals assigned in a class body (only there: a subclass declares its own)."""
    facts: dict[str, tuple[str, ...]] = {}
    for stmt in node.body:
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else getattr(
            stmt, "target", None)
        if not isinstance(target, ast.Name) or target.id not in FACT_NAMES or stmt.value is None:
            continue
        try:
            value = ast.literal_eval(stmt.value)
        except ValueError:
            raise ValueError(f"{where}: {node.name}.{target.id} must be a literal tuple of strings") from None
        if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{where}: {node.name}.{target.id}={value!r} must be a tuple of strings")
        facts[target.id] = value
    return facts


def read_families(models_dir: Path = FAMILIES_DIR, package: str = FAMILIES_PACKAGE) -> tuple[Family, ...]:
    """Every adapter class (a class declaring ``pipeline_classes``) in the family modules of ``models_dir``."""
    found = []
    for path in sorted(models_dir.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                facts = class_facts(node, str(path))
                if facts.get("pipeline_classes"):
                    found.append(Family(f"{package}.{path.stem}:{node.name}", facts["pipeline_classes"],
                                        facts.get("tiny_kinds", ())))
    seen: dict[str, str] = {}
    for family in found:
        for name in family.pipeline_classes + tuple(f"tiny:{k}" for k in family.tiny_kinds):
            if name in seen:
                raise ValueError(f"{name} is declared by both {seen[name]} and {family.adapter}")
            seen[name] = family.adapter
    return tuple(found)


@functools.cache
def families() -> tuple[Family, ...]:
    return read_families()


def adapters_by_pipeline() -> dict[str, str]:
    """diffusers pipeline class → the adapter that serves it (``package.module:Class``)."""
    return {name: f.adapter for f in families() for name in f.pipeline_classes}


def tiny_kinds() -> tuple[str, ...]:
    """Every kind ``make-tiny-model --kind`` builds, in family order."""
    return tuple(kind for f in families() for kind in f.tiny_kinds)


def tiny_builder(kind: str) -> str:
    """The module whose ``build(seed)`` assembles a tiny ``kind``."""
    return "stage_runtime.models.tiny." + kind.replace("-", "_")
