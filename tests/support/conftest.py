"""tests/ on sys.path, so `support.kube_emulator` imports from any test directory; its fixtures for these tests."""

import sys
from pathlib import Path

TESTS = str(Path(__file__).resolve().parents[1])
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

from support.kube_emulator import kube_emulator, kubeconfig  # noqa: F401 (fixtures)
