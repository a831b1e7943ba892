"""Unpack a model archive (tar, tar.gz or zip, told apart by their first bytes) into a folder, safely.

Members that would land outside the folder (absolute paths, `..`, links pointing out), device files and
the like are refused (tar's `data` filter; the same checks for zip). The pipeline is the folder holding
`model_index.json`: the archive's root, or its single top-level folder (`tar czf m.tgz tiny-sd/`).
"""

from __future__ import annotations

import tarfile
import zipfile
from pathlib import Path

from stage_runtime.errors import ConfigError

MODEL_INDEX = "model_index.json"


def kind_of(path: Path) -> str:
    with path.open("rb") as f:
        head = f.read(512)
    if head[:2] == b"\x1f\x8b":
        return "tar.gz"
    if head[:4] == b"PK\x03\x04":
        return "zip"
    if head[257:262] == b"ustar":
        return "tar"
    raise ConfigError(f"{path.name}: not a tar, tar.gz or zip archive (first bytes {head[:8].hex()})")


def _extract_zip(path: Path, dest: Path) -> None:
    root = dest.resolve()
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            target = (dest / info.filename).resolve()
            if info.filename.startswith("/") or not target.is_relative_to(root):
                raise ConfigError(f"{path.name}: member {info.filename!r} would land outside the model folder")
            if (info.external_attr >> 16) & 0o170000 == 0o120000:
                raise ConfigError(f"{path.name}: member {info.filename!r} is a symbolic link (not allowed in zip)")
        archive.extractall(dest)


def extract(path: Path, dest: Path) -> Path:
    """Unpack `path` into the (new, empty) folder `dest`; returns the pipeline folder inside it."""
    dest.mkdir(parents=True, exist_ok=False)
    kind = kind_of(path)
    try:
        if kind == "zip":
            _extract_zip(path, dest)
        else:
            with tarfile.open(path, "r:gz" if kind == "tar.gz" else "r:") as archive:
                archive.extractall(dest, filter="data")
    except (tarfile.TarError, zipfile.BadZipFile, EOFError) as exc:
        raise ConfigError(f"{path.name}: cannot unpack the {kind} archive: {exc}") from None
    return pipeline_root(dest)


def pipeline_root(folder: Path) -> Path:
    if (folder / MODEL_INDEX).is_file():
        return folder
    entries = [p for p in folder.iterdir()]
    if len(entries) == 1 and (entries[0] / MODEL_INDEX).is_file():
        return entries[0]
    names = sorted(p.name for p in entries)[:10]
    raise ConfigError(f"the archive holds no diffusers pipeline: no {MODEL_INDEX} at its root or in a single "
                      f"top-level folder (found {names})")


def folder_bytes(folder: Path) -> int:
    """The size of every regular file under `folder` (links not followed)."""
    return sum(p.lstat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
