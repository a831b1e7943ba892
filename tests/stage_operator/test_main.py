"""`python -m stage_operator`: the real process against the emulated API, and its argument errors."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest
from support.operator_harness import Cluster, manifest, wait_for

from stage_operator.__main__ import build_parser, main


def test_scope_is_required(capsys, monkeypatch):
    monkeypatch.delenv('WATCH_NAMESPACE', raising=False)
    assert main([]) == 2
    assert '--namespace' in capsys.readouterr().err


def test_flags():
    args = build_parser().parse_args(['-n', 'a', '-n', 'b', '--standalone', '--resync-seconds', '5'])
    assert args.namespace == ['a', 'b'] and args.standalone and args.resync_seconds == 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def test_the_operator_process_reconciles_and_stops_cleanly(kube_emulator, tmp_path):
    env = {**os.environ, 'KUBECONFIG': str(kube_emulator.write_kubeconfig(tmp_path / 'kubeconfig'))}
    log, port = tmp_path / 'operator.log', free_port()
    with open(log, 'w') as out:
        proc = subprocess.Popen([sys.executable, '-m', 'stage_operator', '--namespace', 'default', '--standalone',
                                 '--resync-seconds', '1', '--metrics-port', str(port)],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            cluster = Cluster(kube_emulator)
            wait_for(lambda: kube_emulator.watching('diffusionstages'), 60, what='the operator to watch')
            cluster.apply(manifest('tiny'))
            wait_for(lambda: len(cluster.pods('tiny')) == 2, 30, what='two pods')
            cluster.all_ready('tiny')
            wait_for(lambda: cluster.status('tiny').get('phase') == 'Ready', 30, what='Ready')
            metrics = httpx.get(f'http://127.0.0.1:{port}/metrics').text
            assert 'diffstage_operator_reconciles_total{result="changed"}' in metrics
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(30)
    text = log.read_text()
    assert code == 0, text
    assert 'Traceback' not in text, text
    created = next(line for line in text.splitlines() if 'stage default/tiny: create ConfigMap/tiny-config' in line)
    assert all(f'{child}, ' in created or created.endswith(child) or f'{child};' in created
               for child in ('Service/tiny', 'NetworkPolicy/tiny', 'Pod/tiny-0', 'Pod/tiny-1')), created


def test_settings_are_built_from_the_flags_and_checked():
    from stage_operator.__main__ import settings
    from stage_operator.settings import OperatorSettings

    assert settings(build_parser().parse_args(['-n', 'a', '--resync-seconds', '2.5'])) == OperatorSettings(2.5)
    assert settings(build_parser().parse_args(['-n', 'a'])).resync_seconds == 30
    with pytest.raises(ValueError, match='resync_seconds must be > 0, got 0.0'):
        OperatorSettings(0.0)


def test_there_is_no_endpoint_override(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(['-n', 'a', '--endpoint-annotation'])
    assert 'unrecognized arguments: --endpoint-annotation' in capsys.readouterr().err
