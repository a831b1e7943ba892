"""`make e2e-kind` on a machine without Docker or kind (CI, this one): it says why and exits 0."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_kind_e2e(path: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, '-m', 'e2e.kind.run'], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, 'PATH': path, 'PYTHONPATH': str(ROOT)})


def test_without_docker_or_kind_it_skips_with_the_reason(tmp_path):
    out = run_kind_e2e(str(tmp_path))  # an empty PATH: no docker, no kind, no kubectl
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ('make e2e-kind: skipped: docker and kind and kubectl not installed '
                                  '(kind runs Kubernetes in Docker containers)')


def test_with_a_docker_whose_daemon_is_down_it_skips(tmp_path):
    for tool in ('docker', 'kind', 'kubectl'):  # the CLIs exist; only `docker info` decides
        fake = tmp_path / tool
        fake.write_text('#!/bin/sh\necho "Cannot connect to the Docker daemon" >&2\nexit 1\n')
        fake.chmod(0o755)
    (tmp_path / 'sh').symlink_to(shutil.which('sh'))
    out = run_kind_e2e(str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "skipped: the Docker daemon is not reachable ('docker info' failed)" in out.stdout


def test_make_target_runs_this_module():
    makefile = (ROOT / 'Makefile').read_text()
    assert 'e2e-kind: $(STAMP)\n\t$(PY) -m e2e.kind.run' in makefile
