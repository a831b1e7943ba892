"""Shared fixtures: tiny real diffusers pipelines built once per session (no downloads)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from stage_runtime.model_catalog import tiny_kinds  # noqa: E402

# Modules that share a costly session fixture run on one xdist worker (``--dist loadfile`` gives each file to any
# worker, and each worker would build the fixture again): fixture → the modules that use it
# (tests/test_suite_rules.py checks the table against the modules' fixture requests).
ONE_WORKER = {
    "two_rank_runs": ("tests/stage_runtime/distributed/test_cfg_parallel.py",
                      "tests/stage_runtime/distributed/test_families_parallel.py",
                      "tests/stage_runtime/distributed/test_groups.py",
                      "tests/stage_runtime/distributed/test_ulysses.py"),
}


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``, with the modules of each ONE_WORKER entry as one unit of work."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    unit_of = {module: f"shared:{fixture}" for fixture, modules in ONE_WORKER.items() for module in modules}

    class SharedFixtureScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return unit_of.get(module, module)

    return SharedFixtureScheduling(config, log)


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


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A moto S3 server process on loopback for this test session (one per xdist worker), with the fake credentials
    in this process's environment (the stage processes a test starts inherit them)."""
    from support.s3_server import FAKE_CREDENTIALS, S3Server

    saved = {name: os.environ.get(name) for name in FAKE_CREDENTIALS}
    os.environ.update(FAKE_CREDENTIALS)
    server = S3Server(tmp_path_factory.mktemp("s3") / "moto.log").start()
    yield server
    server.stop()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
