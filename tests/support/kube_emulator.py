"""The emulated Kubernetes API lives in e2e/local (the local cluster and `make demo` use it too); these are
its pytest fixtures, and the names tests import from `support.kube_emulator`."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.local.kube_emulator import KubeEmulator, running

__all__ = ['KubeEmulator', 'running', 'kube_emulator', 'kubeconfig']


@pytest.fixture
def kube_emulator() -> Iterator[KubeEmulator]:
    """A fresh emulator per test; the test fails if the emulator itself crashed on a request."""
    with running() as emulator:
        yield emulator
        crashes = list(emulator.errors)
    assert not crashes, f'the Kubernetes emulator crashed on requests: {crashes!r}'


@pytest.fixture
def kubeconfig(kube_emulator: KubeEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """KUBECONFIG points at the emulator, for kopf and `kubernetes.config.load_kube_config()`."""
    import kubernetes
    saved = kubernetes.client.Configuration._default  # load_kube_config() replaces the global default
    path = kube_emulator.write_kubeconfig(tmp_path / 'kubeconfig')
    monkeypatch.setenv('KUBECONFIG', str(path))
    monkeypatch.setattr(kubernetes.config.kube_config, 'KUBE_CONFIG_DEFAULT_LOCATION', str(path))  # read at import
    yield path
    kubernetes.client.Configuration._default = saved
