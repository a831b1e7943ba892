"""The repository root on sys.path, so `e2e.*` imports however pytest was started."""
import sys
from pathlib import Path

import stage_operator  # noqa: F401 (the real packages first, as in tests/conftest.py)
import stage_runtime  # noqa: F401

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.append(ROOT)
