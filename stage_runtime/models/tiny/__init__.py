"""Tiny, randomly initialised (but seeded) diffusers pipelines for tests, demos and the local cluster.

``make_tiny_model(out_dir, kind)`` writes a real pipeline folder with ``save_pretrained`` that loads back
with ``DiffusionPipeline.from_pretrained(out_dir, local_files_only=True)``. Nothing is downloaded; the
tokenizers are built in code. One module per kind, each with ``build(seed) -> DiffusionPipeline``;
``make_tiny_models(out_dir)`` writes every kind as ``out_dir/tiny-<kind>`` (the runtime image's prebuilt models).
One kind is trained, not random (``TRAINED_KINDS``): ``digits`` writes the DiT trained by ``stage-runtime
train-tiny`` and shipped in ``trained/`` (docs/trained-model.md), the same files for every seed.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from stage_runtime import model_catalog

# kind → the module whose ``build(seed)`` assembles it (imported only when that kind is built). The kinds are
# the adapters' own ``tiny_kinds`` (stage_runtime.model_catalog); kind ``k`` lives in ``tiny/<k with - as _>.py``.
KINDS = model_catalog.tiny_kinds()
BUILDERS: dict[str, str] = {kind: model_catalog.tiny_builder(kind) for kind in KINDS}
TRAINED_KINDS = ("digits",)            # weights trained and shipped (models/tiny/trained/), not drawn from the seed


def make_tiny_model(out_dir: str | Path, kind: str = "sd", seed: int = 0) -> Path:
    """Write a tiny random-weight diffusers pipeline of ``kind`` to ``out_dir`` and return it.

    Same ``seed`` gives bitwise-identical weight files (a trained kind: the shipped files, whatever the seed); the
    caller's torch RNG state is left untouched. Raises ``ValueError`` for an unknown ``kind``.
    """
    if kind not in BUILDERS:
        raise ValueError(f"unknown tiny model kind={kind!r}; expected one of {KINDS}")
    pipe = importlib.import_module(BUILDERS[kind]).build(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)
    return out


def make_tiny_models(out_dir: str | Path, seed: int = 0) -> list[Path]:
    """Every kind, each to ``out_dir/tiny-<kind>`` (the runtime image bakes them: ``make-tiny-model DIR --all``)."""
    return [make_tiny_model(Path(out_dir) / f"tiny-{kind}", kind=kind, seed=seed) for kind in KINDS]


def builtin_name(kind: str) -> str:
    return f"tiny-{kind}"


def builtin_folder(name: str, root: str | Path) -> Path | None:
    """The pipeline folder of built-in model ``name`` (``tiny-<kind>``, as the CRD's ``builtin`` names it), or None
    when ``name`` is no built-in: the shipped folder of a trained kind; otherwise built once (seed 0) under ``root``
    and reused (written to a temporary folder, then renamed, so a half-written one is never served)."""
    kind = name.removeprefix("tiny-")
    if not name.startswith("tiny-") or kind not in BUILDERS:
        return None
    if kind in TRAINED_KINDS:
        return importlib.import_module(BUILDERS[kind]).FOLDER
    out = Path(root) / name
    if not (out / "model_index.json").is_file():
        import tempfile

        Path(root).mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        make_tiny_model(partial, kind=kind)
        try:
            partial.rename(out)
        except OSError:                        # another process built it first: use theirs
            import shutil

            shutil.rmtree(partial, ignore_errors=True)
    return out
