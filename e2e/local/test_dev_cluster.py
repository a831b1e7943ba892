"""`make cluster` as a newcomer runs it: `python -m e2e.local.dev_cluster --workdir .cluster` (a relative workdir,
in a temp folder as working directory so nothing lands in the repository), the KUBECONFIG it prints, the sample
`kubectl apply -f manifests/samples/tiny-cpu.yaml` as shipped (2 replicas of 2 CPU ranks: Ready in ~20 s here),
`kubectl wait`, one image through the Service by the URL the guide prints, `kubectl logs` of a pod, then Ctrl-C: no
process of it and no /dev/shm segment left, the containers' logs kept under .cluster/logs."""
from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from e2e import scenario
from e2e.local.kubectl import KUBECTL, KUBECTL_MISSING, Kubectl
from e2e.local.pod_process import parent_pid, proc_stat

pytestmark = [pytest.mark.skipif(KUBECTL is None, reason=KUBECTL_MISSING),
              pytest.mark.skipif(not sys.platform.startswith('linux'), reason='reads /proc: Linux only'),
              pytest.mark.timeout(300)]


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


def guided_request(lines: list[str]) -> tuple[str, dict]:
    """The curl the guide prints, as (URL, JSON body)."""
    text = ''.join(lines)
    url = re.search(r"curl -s (\S+/proxy/v1/images/generations)", text)
    body = re.search(r"-d '(\{.*?\})'", text)
    assert url and body, text
    return url[1], json.loads(body[1])


def test_make_cluster_runs_the_sample_for_kubectl_until_ctrl_c(tmp_path):
    workdir = tmp_path / '.cluster'
    earlier_log = workdir / 'logs' / 'default_tiny-0_uid-before' / 'stage' / '0.log'
    earlier_log.parent.mkdir(parents=True)
    earlier_log.write_text('an earlier session\n')
    (workdir / 'pod-runner-stale').mkdir()  # what an earlier session left: emptied at the start, but for the logs
    proc = subprocess.Popen([sys.executable, '-m', 'e2e.local.dev_cluster', '--workdir', '.cluster'],  # make cluster
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, 'PYTHONPATH': str(scenario.ROOT)})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        # step 1: up; the KUBECONFIG to export is absolute, in the workdir under the working directory
        export = scenario.wait_for(lambda: next((line for line in lines if 'export KUBECONFIG=' in line), None), 90,
                                   'the KUBECONFIG line', lambda: ''.join(lines))
        kubeconfig = export.split('=', 1)[1].strip()
        assert Path(kubeconfig) == workdir.resolve() / 'kubeconfig'
        kubectl = Kubectl(kubeconfig)
        assert 'No resources found' in kubectl('get', 'dstage').stderr
        kubectl('create', 'service', 'clusterip', 'idle', '--tcp=8000')  # a Service whose selector finds no pod
        url, _ = guided_request(lines)
        no_pods = httpx.get(url.replace('/tiny:http/proxy/v1/images/generations', '/idle/proxy/health'), timeout=10)
        assert no_pods.status_code == 503 and 'no endpoints available' in no_pods.json()['message'], no_pods.text
        # step 2: the sample as shipped, Ready
        applied = kubectl('apply', '-f', str(scenario.SAMPLE))
        assert applied.stdout.strip() == 'diffusionstage.diffstage.io/tiny created', applied
        kubectl('wait', '--for=condition=Ready', 'dstage/tiny', '--timeout=180s', timeout=190)
        assert kubectl('get', 'dstage', 'tiny').stdout.splitlines()[1].split()[:4] == ['tiny', 'Ready', '2', '2']
        # step 3: an image through the Service, as the guide says to ask for it
        url, body = guided_request(lines)
        answer = httpx.post(url, json={**body, 'num_inference_steps': 2}, timeout=120)
        assert answer.status_code == 200, answer.text
        assert base64.b64decode(answer.json()['data'][0]['b64_json']).startswith(b'\x89PNG')
        # step 4: the stage's own log through kubectl
        logs = kubectl('logs', 'tiny-0')
        assert 'ready: ' in logs.stdout and 'listening http=http://127.' in logs.stdout, logs.stdout[-3000:]
        assert 'Defaulted container "stage"' in logs.stderr, logs.stderr
        uid = kubectl('get', 'pod', 'tiny-0', '-o', 'jsonpath={.metadata.uid}').stdout
        children = descendants(proc.pid)
        assert len(children) >= 5, 'the operator, two stage processes and their ranks run as child processes'
        # step 5: Ctrl-C stops everything and leaves nothing running
        proc.send_signal(signal.SIGINT)
        assert proc.wait(90) == 0, ''.join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(10)
    output = ''.join(lines)
    assert 'stopped: no process left, no /dev/shm segment left' in output, output
    assert not {pid for pid in children if (st := proc_stat(pid)) and st[0] != 'Z'}, 'every child process has exited'
    kept = workdir / 'logs' / f'default_tiny-0_{uid}' / 'stage' / '0.log'
    assert ' ready: ' in kept.read_text(), 'the log outlives the cluster, where the guide says'
    assert not list(workdir.glob('pod-runner-*')), 'the pod sandboxes are removed'
    assert earlier_log.read_text() == 'an earlier session\n', 'a restart keeps the logs of earlier sessions'
