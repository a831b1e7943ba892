"""tests/ on sys.path, so `support.*` imports from here; the emulator fixtures for the operator tests.

The real packages are imported first: with tests/ on sys.path, tests/stage_operator would otherwise be
picked up as a namespace package named `stage_operator` (the editable install's finder comes last).
"""

import sys
from pathlib import Path

import stage_operator.api  # noqa: F401 (see above)
import stage_runtime.config  # noqa: F401

TESTS = str(Path(__file__).resolve().parents[1])
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

from support.kube_emulator import kube_emulator, kubeconfig  # noqa: E402,F401 (fixtures)
