"""The emulator's fixtures for these tests (tests/ is on the path: pyproject.toml's pytest pythonpath)."""

from support.kube_emulator import kube_emulator, kubeconfig  # noqa: F401 (fixtures)
