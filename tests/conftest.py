"""Shared fixtures: tiny real diffusers pipelines built once per session (no downloads)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

# The real packages before any conftest puts tests/ on sys.path: tests/stage_operator (no __init__.py) would
# otherwise be imported as a namespace package named `stage_operator` (the editable finder runs last).
import stage_operator  # noqa: E402,F401
import stage_runtime  # noqa: E402,F401

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

# The repository root on sys.path: the emulated Kubernetes API is `e2e.local.kube_emulator` (tests/support
# re-exports it), also when pytest is started as a script rather than `python -m pytest`.
ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.append(ROOT)


@pytest.fixture(scope="session")
def tiny_sd_path(tmp_path_factory) -> str:
    from stage_runtime.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-sd", kind="sd", seed=0))


@pytest.fixture(scope="session")
def tiny_dit_path(tmp_path_factory) -> str:
    from stage_runtime.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-dit", kind="dit", seed=0))


# Fault-injecting model adapters are importable as "adapters_for_tests:Class" (the registry override).
sys.path.insert(0, str(Path(__file__).parent / "stage_runtime"))
