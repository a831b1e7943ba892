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


@pytest.fixture(scope="session")
def tiny_flux_kontext_path(tmp_path_factory) -> str:
    from stage_runtime.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-flux-kontext", kind="flux-kontext", seed=0))


def _save_variant(sd_path: str, out, cls_name: str, **extra) -> str:
    """A diffusers pipeline class without a dedicated adapter, built from the tiny SD components."""
    import inspect

    import diffusers

    cls = getattr(diffusers, cls_name)
    sd = diffusers.DiffusionPipeline.from_pretrained(sd_path, local_files_only=True)
    accepted = inspect.signature(cls.__init__).parameters
    cls(**{k: v for k, v in sd.components.items() if k in accepted}, **extra).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def tiny_pag_path(tiny_sd_path, tmp_path_factory) -> str:
    """StableDiffusionPAGPipeline (perturbed-attention guidance on the mid block): callback_on_step_end."""
    return _save_variant(tiny_sd_path, tmp_path_factory.mktemp("models") / "tiny-pag", "StableDiffusionPAGPipeline",
                         pag_applied_layers=["mid"])


@pytest.fixture(scope="session")
def tiny_sag_path(tiny_sd_path, tmp_path_factory) -> str:
    """StableDiffusionSAGPipeline: its __call__ has no callback_on_step_end (only the legacy callback)."""
    return _save_variant(tiny_sd_path, tmp_path_factory.mktemp("models") / "tiny-sag", "StableDiffusionSAGPipeline")


@pytest.fixture(scope="session")
def tiny_sdxl_path(tmp_path_factory) -> str:
    from stage_runtime.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-sdxl", kind="sdxl", seed=0))


@pytest.fixture(scope="session")
def tiny_qwen_image_path(tmp_path_factory) -> str:
    from stage_runtime.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen-image", kind="qwen-image", seed=0))
