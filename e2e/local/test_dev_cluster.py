"""`make cluster` (python -m e2e.local.dev_cluster): it starts, prints the KUBECONFIG to export, kubectl works
against it from another process, and Ctrl-C stops everything: no process of it and no /dev/shm segment left."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import yaml

from e2e import scenario
from e2e.local.kubectl import KUBECTL, KUBECTL_MISSING, Kubectl
from e2e.local.pod_process import parent_pid, proc_stat

pytestmark = [pytest.mark.skipif(KUBECTL is None, reason=KUBECTL_MISSING),
              pytest.mark.skipif(not sys.platform.startswith('linux'), reason='reads /proc: Linux only')]


def descendants(root: int) -> set[int]:
    parents: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir('/proc')):
        if (parent := parent_pid(int(entry))) is not None:
            parents.setdefault(parent, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def test_make_cluster_serves_kubectl_until_ctrl_c(tmp_path):
    workdir = tmp_path / 'cluster'
    proc = subprocess.Popen([sys.executable, '-m', 'e2e.local.dev_cluster', '--workdir', str(workdir)],
                            cwd=scenario.ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, 'PYTHONPATH': str(scenario.ROOT)})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        export = scenario.wait_for(lambda: next((line for line in lines if 'export KUBECONFIG=' in line), None), 90,
                                   'the KUBECONFIG line', lambda: ''.join(lines))
        kubeconfig = export.split('=', 1)[1].strip()
        assert Path(kubeconfig) == (workdir / 'kubeconfig').resolve()
        kubectl = Kubectl(kubeconfig)
        assert 'No resources found' in kubectl('get', 'dstage').stderr
        idle = scenario.with_spec(scenario.sample(), replicas=0)  # the operator works; no pod to wait for
        kubectl('apply', '-f', '-', input=yaml.safe_dump(idle))
        kubectl('wait', '--for=jsonpath={.status.observedGeneration}=1', 'dstage/tiny', '--timeout=60s', timeout=70)
        assert kubectl('get', 'dstage', 'tiny', '-o', 'jsonpath={.status.replicas}').stdout == '0'
        api = next(line for line in lines if 'Kubernetes API http' in line).split('API ', 1)[1].split()[0]
        no_pods = httpx.get(f'{api}/api/v1/namespaces/default/services/tiny:http/proxy/health', timeout=10)
        assert no_pods.status_code == 503 and 'no endpoints available' in no_pods.json()['message']
        children = descendants(proc.pid)
        assert children, 'the operator runs as a child process'
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(90) == 0, ''.join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(10)
    output = ''.join(lines)
    assert 'stopped: no process left, no /dev/shm segment left' in output, output
    assert not {pid for pid in children if (st := proc_stat(pid)) and st[0] != 'Z'}, 'every child process has exited'
