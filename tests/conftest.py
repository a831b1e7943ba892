"""Shared fixtures: tiny real diffusers pipelines built once per session (no downloads)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from stage_runtime.model_catalog import tiny_kinds  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model(kind)`` → the folder of that tiny pipeline (seed 0), built once per session on first use."""
    from stage_runtime.models.tiny import make_tiny_model

    built: dict[str, str] = {}

    def build(kind: str) -> str:
        if kind not in built:
            out = tmp_path_factory.mktemp("models") / f"tiny-{kind}"
            built[kind] = str(make_tiny_model(out, kind=kind, seed=0))
        return built[kind]

    return build


def _kind_fixture(kind: str):
    @pytest.fixture(scope="session")
    def path(tiny_model) -> str:
        return tiny_model(kind)

    path.__doc__ = f"The tiny {kind} pipeline folder (``tiny_model({kind!r})``)."
    return path


# tiny_sd_path, tiny_dit_path, tiny_flux_kontext_path, …: one per kind the adapters declare (model_catalog).
for _kind in tiny_kinds():
    globals()[f"tiny_{_kind.replace('-', '_')}_path"] = _kind_fixture(_kind)


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
