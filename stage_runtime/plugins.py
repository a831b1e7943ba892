"""Plugin paths: ``package.module:Name`` strings that name an adapter or an executor class.

The registry and the executor factory resolve them here, imported only when used (cheap to import).
"""

from __future__ import annotations

import importlib

from stage_runtime.errors import DiffStageError, ModelLoadError


def import_object(path: str, error: type[DiffStageError] = ModelLoadError) -> type:
    """Import ``package.module:Name``; ``error`` (with the path and the cause) when it cannot be."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise error(f"cannot import {path!r}: expected 'package.module:Name'")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise error(f"cannot import {path!r}: {exc}") from None
