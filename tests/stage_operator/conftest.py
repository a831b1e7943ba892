"""The emulator fixtures for the operator tests (`support` is importable: pyproject.toml's pytest pythonpath)."""

from support.kube_emulator import kube_emulator, kubeconfig  # noqa: F401 (fixtures)
