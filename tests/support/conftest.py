"""Make `support.kube_emulator` importable from any test directory (tests/ on sys.path)."""

import sys
from pathlib import Path

TESTS = str(Path(__file__).resolve().parents[1])
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
