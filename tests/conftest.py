"""Shared fixtures: tiny real diffusers pipelines built once per session (no downloads)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_sd_path(tmp_path_factory) -> str:
    from stage_runtime.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-sd", kind="sd", seed=0))


@pytest.fixture(scope="session")
def tiny_dit_path(tmp_path_factory) -> str:
    from stage_runtime.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-dit", kind="dit", seed=0))


@pytest.fixture(scope="session")
def tiny_sd3_path(tmp_path_factory) -> str:
    from stage_runtime.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-sd3", kind="sd3", seed=0))


@pytest.fixture(scope="session")
def tiny_flux_path(tmp_path_factory) -> str:
    from stage_runtime.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-flux", kind="flux", seed=0))
