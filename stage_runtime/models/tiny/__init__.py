"""Tiny, randomly initialised (but seeded) diffusers pipelines for tests, demos and the local cluster.

``make_tiny_model(out_dir, kind)`` writes a real pipeline folder with ``save_pretrained`` that loads back
with ``DiffusionPipeline.from_pretrained(out_dir, local_files_only=True)``. Nothing is downloaded; the
tokenizers are built in code. One module per kind, each with ``build(seed) -> DiffusionPipeline``.
"""

from __future__ import annotations

import importlib
from pathlib import Path

# kind → the module whose ``build(seed)`` assembles it (imported only when that kind is built).
BUILDERS: dict[str, str] = {
    "flux": "stage_runtime.models.tiny.flux",
    "flux-kontext": "stage_runtime.models.tiny.flux_kontext",
    "sd3": "stage_runtime.models.tiny.sd3",
    "sd": "stage_runtime.models.tiny.sd",
    "dit": "stage_runtime.models.tiny.dit",
    "sdxl": "stage_runtime.models.tiny.sdxl",
    "qwen-image": "stage_runtime.models.tiny.qwen_image",
}
KINDS = tuple(BUILDERS)


def make_tiny_model(out_dir: str | Path, kind: str = "sd", seed: int = 0) -> Path:
    """Write a tiny random-weight diffusers pipeline of ``kind`` to ``out_dir`` and return it.

    Same ``seed`` gives bitwise-identical weight files; the caller's torch RNG state is
    left untouched. Raises ``ValueError`` for an unknown ``kind``.
    """
    if kind not in BUILDERS:
        raise ValueError(f"unknown tiny model kind={kind!r}; expected one of {KINDS}")
    pipe = importlib.import_module(BUILDERS[kind]).build(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)
    return out
