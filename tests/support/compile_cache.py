"""The compile cache the tests share: one folder in the system temp folder for every test process of a run (and of
later runs on the same machine), so only the first stage to compile a model's graphs pays the cold compile. Inductor
writes its cache entries atomically, so concurrent processes may share it. A test that needs a cold compile makes its
own folder instead."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def shared_compile_cache() -> Path:
    folder = Path(tempfile.gettempdir()) / f"diffstage-tests-compile-cache-{os.getuid()}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder
