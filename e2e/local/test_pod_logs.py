"""`kubectl logs` against the local cluster (the emulated API's `pods/log`, the local kubelet's log files): plain,
`--tail`, `--limit-bytes`, `--timestamps`, `-c`, `-f` streaming until the container exits, `--previous` after a
restart (restartPolicy OnFailure), the refusals a real cluster answers (unknown container, no previous run, a
container still waiting for its Secret), and the files kept where container_logs.py says; a pod waiting for the
Secrets of its volume and its env (FailedMount, CreateContainerConfigError) until they appear.

The pods are small python processes (no stage), run by the pod runner alone: this is the kubelet's part.
The stage's own logs through `kubectl logs` are in test_dev_cluster.py and test_local_cluster.py.
"""
from __future__ import annotations

import subprocess
import sys
import threading
from types import SimpleNamespace

import httpx
import pytest
import yaml

from e2e import scenario
from e2e.local.container_logs import ContainerLogs, parse_time
from e2e.local.kube_emulator import running
from e2e.local.kubectl import KUBECTL, KUBECTL_MISSING, Kubectl
from e2e.local.pod_runner import PodRunner

pytestmark = [pytest.mark.skipif(KUBECTL is None, reason=KUBECTL_MISSING),
              pytest.mark.skipif(not sys.platform.startswith('linux'), reason='the pod runner reads /proc: Linux only'),
              pytest.mark.timeout(120)]
TALK = '''
import os, pathlib, time
for i in range(1, 6):
    print(f"line {i}", flush=True)
stop = pathlib.Path(os.environ["STOP"])
while not stop.exists():
    time.sleep(0.05)
print("stopping", flush=True)
'''
COUNT = '''
import os, pathlib, sys
counter = pathlib.Path(os.environ["COUNTER"])
run = int(counter.read_text()) if counter.exists() else 0
counter.write_text(str(run + 1))
print(f"run {run}", flush=True)
print(f"run {run} on stderr", file=sys.stderr, flush=True)
sys.exit(1 if run < 2 else 0)
'''


@pytest.fixture(scope='module')
def node(tmp_path_factory):
    root = tmp_path_factory.mktemp('pod-logs')
    with running() as api:
        api.logs = logs = ContainerLogs(root / 'logs')
        runner = PodRunner(api.base_url, root=root, logs=logs).start()
        try:
            scenario.wait_for(lambda: api.watching('pods'), 30, 'the pod runner to watch pods')
            yield SimpleNamespace(api=api, runner=runner, logs=logs, root=root,
                                  kubectl=Kubectl(api.write_kubeconfig(root / 'kubeconfig')))
        finally:
            runner.close()
        crashes = list(api.errors)
    assert not crashes, f'the emulator crashed on requests: {crashes!r}'
    assert not runner.errors and not runner.leftovers, (runner.errors, runner.leftovers)


def pod(name: str, script: str, restart: str = 'Never', env: dict | None = None, volumes: list | None = None,
        mounts: list | None = None) -> str:
    container = {'name': name, 'image': 'python:3.11', 'command': [sys.executable, '-u', '-c', script],
                 'env': [{'name': k, 'value': v} for k, v in (env or {}).items()], 'volumeMounts': mounts or []}
    return yaml.safe_dump({'apiVersion': 'v1', 'kind': 'Pod', 'metadata': {'name': name}, 'spec': {
        'restartPolicy': restart, 'terminationGracePeriodSeconds': 2, 'containers': [container],
        'volumes': volumes or []}})


def status(node, name: str) -> dict:
    return (node.api.get('pods', name) or {}).get('status') or {}


def container_state(node, name: str) -> dict:
    return next(iter(status(node, name).get('containerStatuses') or ()), {})


def delete(node, name: str) -> None:
    node.kubectl('delete', 'pod', name, '--wait=false')
    scenario.wait_for(lambda: f'default/{name}' not in node.runner.running(), 30, f'pod {name} to stop')


def test_logs_of_a_running_pod_with_tail_limit_bytes_timestamps_and_container(node, tmp_path):
    kubectl = node.kubectl
    kubectl('apply', '-f', '-', input=pod('talker', TALK, env={'STOP': str(tmp_path / 'never')}))
    try:
        scenario.wait_for(lambda: 'line 5' in kubectl('logs', 'talker', check=False).stdout, 30,
                          'the five lines in kubectl logs', lambda: status(node, 'talker'))
        assert kubectl('logs', 'talker').stdout == ''.join(f'line {i}\n' for i in range(1, 6))
        assert kubectl('logs', 'talker', '--tail=2').stdout == 'line 4\nline 5\n'
        assert kubectl('logs', 'talker', '--limit-bytes=9').stdout == 'line 1\nli'
        assert kubectl('logs', 'talker', '-c', 'talker', '--since=1h').stdout.count('\n') == 5
        stamped = kubectl('logs', 'talker', '--timestamps', '--tail=1').stdout
        stamp, text = stamped.rstrip('\n').split(' ', 1)
        assert text == 'line 5' and abs(parse_time(stamp) - parse_time(container_state(node, 'talker')['state'][
            'running']['startedAt'])) < 60, stamped
        unknown = kubectl('logs', 'talker', '-c', 'nope', check=False)  # kubectl 1.32 checks the name itself
        assert unknown.returncode == 1 and unknown.stderr.strip() == 'error: container nope is not valid for pod talker'
        first_run = kubectl('logs', 'talker', '--previous', check=False)
        assert first_run.returncode == 1 and first_run.stderr.strip() == (
            'Error from server (BadRequest): previous terminated container "talker" in pod "talker" not found')
    finally:
        delete(node, 'talker')


def test_follow_streams_while_the_container_runs_and_ends_when_it_exits(node, tmp_path):
    kubectl, stop = node.kubectl, tmp_path / 'stop'
    kubectl('apply', '-f', '-', input=pod('follower', TALK, env={'STOP': str(stop)}))
    try:
        scenario.wait_for(lambda: container_state(node, 'follower').get('state', {}).get('running'), 30,
                          'the container to run', lambda: status(node, 'follower'))
        follow = subprocess.Popen([kubectl.binary, 'logs', '-f', 'follower'], env=kubectl.env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(follow.stdout), daemon=True)
        reader.start()
        try:
            # step 1: what the container wrote so far arrives while it still runs
            scenario.wait_for(lambda: 'line 5\n' in lines, 30, 'line 5 through kubectl logs -f', lambda: lines)
            assert follow.poll() is None and 'running' in container_state(node, 'follower')['state']
            # step 2: the container writes its last line and exits: the follow prints it and ends by itself
            stop.touch()
            assert follow.wait(30) == 0, follow.stderr.read()
        finally:
            if follow.poll() is None:
                follow.kill()
            reader.join(10)
        assert lines == [f'line {i}\n' for i in range(1, 6)] + ['stopping\n']
        scenario.wait_for(lambda: status(node, 'follower').get('phase') in ('Succeeded', 'Failed'), 30, 'the pod ended')
        assert status(node, 'follower')['phase'] == 'Succeeded', status(node, 'follower')
        assert kubectl('logs', 'follower', '-f').stdout.endswith('stopping\n'), 'a finished container: -f ends'
    finally:
        delete(node, 'follower')


def test_previous_is_the_run_before_the_restart_and_every_run_keeps_its_file(node):
    kubectl = node.kubectl
    kubectl('apply', '-f', '-', input=pod('counter', COUNT, restart='OnFailure', env={'COUNTER': '/state/count'},
                                          volumes=[{'name': 'state', 'emptyDir': {}}],
                                          mounts=[{'name': 'state', 'mountPath': '/state'}]))
    try:
        phase = scenario.wait_for(lambda: status(node, 'counter').get('phase') in ('Succeeded', 'Failed') and
                                  status(node, 'counter')['phase'], 60, 'runs 0 and 1 failing, run 2 ending',
                                  lambda: status(node, 'counter'))
        assert phase == 'Succeeded', status(node, 'counter')
        state = container_state(node, 'counter')
        assert state['restartCount'] == 2 and state['lastState']['terminated']['exitCode'] == 1, state
        assert state['state']['terminated']['exitCode'] == 0, state
        assert kubectl('get', 'pod', 'counter').stdout.split('\n')[1].split()[1:4] == ['0/1', 'Completed', '2']
        assert sorted(kubectl('logs', 'counter').stdout.splitlines()) == ['run 2', 'run 2 on stderr']
        assert sorted(kubectl('logs', 'counter', '--previous').stdout.splitlines()) == ['run 1', 'run 1 on stderr']
        events = kubectl('get', 'events', '--field-selector', 'involvedObject.name=counter', '-o',
                         'jsonpath={range .items[*]}{.reason}: {.message}{"\\n"}{end}').stdout
        assert 'BackOff: Back-off restarting failed container counter in pod counter_default' in events, events
        uid = node.api.get('pods', 'counter')['metadata']['uid']
        folder = node.logs.root / f'default_counter_{uid}' / 'counter'
        assert sorted(p.name for p in folder.iterdir()) == ['0.log', '1.log', '2.log']
    finally:
        delete(node, 'counter')
    assert ' stdout F run 0' in (folder / '0.log').read_text(), 'every run keeps its log, after the pod too'


def test_a_pod_waiting_for_its_secrets_says_why_then_starts_when_they_appear(node):
    """A Secret volume (FailedMount until the Secret exists), then a Secret key in env (CreateContainerConfigError
    until that one exists): the pod waits, says why where a kubelet says it, and starts once both are there."""
    kubectl = node.kubectl
    reads = "import os, pathlib; print(pathlib.Path(os.environ['KEY']).read_text(), os.environ['TOKEN'], flush=True)"
    manifest = yaml.safe_load(pod('keyed', reads, env={'KEY': '/keys/api-key'}, volumes=[
        {'name': 'keys', 'secret': {'secretName': 'late', 'items': [{'key': 'token', 'path': 'api-key'}]}}],
        mounts=[{'name': 'keys', 'mountPath': '/keys', 'readOnly': True}]))
    manifest['spec']['containers'][0]['env'].append(
        {'name': 'TOKEN', 'valueFrom': {'secretKeyRef': {'name': 'later', 'key': 'token'}}})

    def pod_status() -> list[str]:
        return kubectl('get', 'pod', 'keyed').stdout.split('\n')[1].split()[1:3]

    def secret(name: str, token: str) -> str:
        return yaml.safe_dump({'apiVersion': 'v1', 'kind': 'Secret', 'metadata': {'name': name},
                               'stringData': {'token': token}})

    kubectl('apply', '-f', '-', input=yaml.safe_dump(manifest))
    try:
        # step 1: no Secret for the volume: not started, FailedMount
        event = 'MountVolume.SetUp failed for volume "keys" : secret "late" not found'
        describe = scenario.wait_for(lambda: event in (d := kubectl('describe', 'pod', 'keyed').stdout) and d, 30,
                                     'the FailedMount Event', lambda: kubectl('describe', 'pod', 'keyed').stdout)
        assert 'FailedMount' in describe.split('Events:')[1]
        assert pod_status() == ['0/1', 'ContainerCreating']
        waiting = kubectl('logs', 'keyed', check=False)
        assert waiting.stderr.strip() == ('Error from server (BadRequest): container "keyed" in pod "keyed" is '
                                          'waiting to start: ContainerCreating')
        # step 2: the volume's Secret, not yet the env's: the container waits with the kubelet's reason
        kubectl('apply', '-f', '-', input=secret('late', 'sk-1'))
        scenario.wait_for(lambda: pod_status() == ['0/1', 'CreateContainerConfigError'], 30,
                          'CreateContainerConfigError', lambda: status(node, 'keyed'))
        assert container_state(node, 'keyed')['state']['waiting']['message'] == 'secret "later" not found'
        # step 3: both there: it runs, with the file and the variable
        kubectl('apply', '-f', '-', input=secret('later', 'sk-2'))
        phase = scenario.wait_for(lambda: status(node, 'keyed').get('phase') in ('Succeeded', 'Failed') and
                                  status(node, 'keyed')['phase'], 30, 'the pod to run', lambda: status(node, 'keyed'))
        assert phase == 'Succeeded', (status(node, 'keyed'), kubectl('logs', 'keyed', check=False))
        assert kubectl('logs', 'keyed').stdout == 'sk-1 sk-2\n'
    finally:
        delete(node, 'keyed')
        node.kubectl('delete', 'secret', 'late', 'later', '--ignore-not-found')


def test_the_api_checks_log_options_and_container_names_as_kube_apiserver(node):
    node.api.seed('pods', {'metadata': {'name': 'two', 'namespace': 'default', 'uid': 'two-uid'},
                           'spec': {'containers': [{'name': 'a'}, {'name': 'b'}]}, 'status': {'phase': 'Failed'}})
    try:
        with httpx.Client(base_url=node.api.base_url, timeout=10) as http:
            def answer(params: dict) -> tuple[int, str]:
                body = http.get('/api/v1/namespaces/default/pods/two/log', params=params).json()
                return body['code'], body['message']

            assert answer({}) == (400, 'a container name must be specified for pod two, choose one of: [a b]')
            assert answer({'container': 'c'}) == (400, 'container c is not valid for pod two')
            assert answer({'container': 'a', 'tailLines': '-2'}) == (
                422, 'PodLogOptions "two" is invalid: tailLines: Invalid value: -2: must be greater than or equal to 0')
            assert answer({'container': 'a', 'sinceSeconds': '5', 'sinceTime': '2026-01-01T00:00:00Z'}) == (
                422, 'PodLogOptions "two" is invalid: Forbidden: at most one of `sinceTime` or `sinceSeconds` may be '
                     'specified')
            assert answer({'container': 'a'}) == (400, 'container "a" in pod "two" is not available')
            missing = http.get('/api/v1/namespaces/default/pods/nope/log')
            assert missing.status_code == 404 and missing.json()['message'] == 'pods "nope" not found'
    finally:
        node.kubectl('delete', 'pod', 'two', '--wait=false')
