"""The repository root on sys.path, so `e2e.*` imports however pytest was started; offline, one thread per
torch process (the pods of the local cluster inherit this environment)."""
import os
import sys
from pathlib import Path

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TRANSFORMERS_OFFLINE', '1')
os.environ.setdefault('OMP_NUM_THREADS', '1')

import stage_operator  # noqa: F401 (the real packages first, as in tests/conftest.py)
import stage_runtime  # noqa: F401

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.append(ROOT)
