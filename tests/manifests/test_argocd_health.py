"""manifests/argocd/health.lua, run by Lua 5.1 (Argo CD's gopher-lua dialect) through lupa, against
DiffusionStage objects recorded from the operator's reconcile (health_cases.py), one per outcome."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from health_cases import ARGOCD, CASES, record

SCRIPT = (ARGOCD / 'health.lua').read_text()
TESTS = yaml.safe_load((ARGOCD / 'health_test.yaml').read_text())['tests']


def health(obj: dict) -> dict:
    from lupa.lua51 import LuaRuntime

    lua = LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute(SCRIPT)
    return {'status': result['status'], 'message': result['message']}


@pytest.mark.parametrize('case', TESTS, ids=[t['inputPath'] for t in TESTS])
def test_health_of_each_recorded_stage(case):
    obj = yaml.safe_load((ARGOCD / case['inputPath']).read_text())
    got = health(obj)
    assert got['status'] == case['healthStatus']['status'], got
    if 'message' in case['healthStatus']:
        assert got['message'] == case['healthStatus']['message']


def test_every_outcome_is_covered():
    by_file = {Path(t['inputPath']).stem: t['healthStatus']['status'] for t in TESTS}
    assert set(by_file.values()) == {'Healthy', 'Progressing', 'Degraded', 'Suspended'}
    assert by_file['generation-not-observed'] == by_file['rolling-update'] == 'Progressing'
    assert by_file['stalled-invalid-spec'] == by_file['accepted-false-insufficient-gpus'] == 'Degraded'
    gpus = yaml.safe_load((ARGOCD / 'testdata' / 'accepted-false-insufficient-gpus.yaml').read_text())
    assert health(gpus)['message'].startswith('InsufficientGPUCapacity: ')
    assert set(by_file) == set(CASES)
    failed = health(yaml.safe_load((ARGOCD / 'testdata' / 'rollout-failed.yaml').read_text()))
    assert failed['message'].startswith('RolloutFailed: revision ') and 'ConfigError (exit code 2)' in failed['message']
    assert failed['message'].endswith('(1/2 replicas ready)'), 'Degraded though the old revision serves'


def test_a_stale_healthy_status_is_not_healthy():
    """The same status reads Healthy until the spec changes, then Progressing until the operator catches up."""
    healthy = yaml.safe_load((ARGOCD / 'testdata' / 'healthy.yaml').read_text())
    assert health(healthy)['status'] == 'Healthy'
    healthy['metadata']['generation'] += 1
    assert health(healthy)['status'] == 'Progressing'


def test_a_stage_being_deleted_is_progressing_as_argo_cd_shows_any_deleting_resource():
    """Its pods drain first: the recorded Terminating status names them; a status written before the deletion
    was seen (still Ready) does not make a deleting stage Healthy."""
    deleting = yaml.safe_load((ARGOCD / 'testdata' / 'deleting.yaml').read_text())
    assert deleting['status']['phase'] == 'Terminating' and health(deleting)['status'] == 'Progressing'
    healthy = yaml.safe_load((ARGOCD / 'testdata' / 'healthy.yaml').read_text())
    healthy['metadata']['deletionTimestamp'] = '2026-01-01T00:01:00Z'
    assert health(healthy) == {'status': 'Progressing', 'message': 'being deleted'}


@pytest.mark.parametrize('name', sorted(CASES))
def test_recorded_objects_are_what_the_operator_writes_today(name):
    recorded = yaml.safe_load((ARGOCD / 'testdata' / f'{name}.yaml').read_text())
    assert recorded == record(name), 're-record: .venv/bin/python tests/manifests/health_cases.py --write'


def test_argocd_cm_installs_this_script():
    cm = yaml.safe_load((ARGOCD / 'argocd-cm.yaml').read_text())
    assert cm['data']['resource.customizations.health.diffstage.io_DiffusionStage'].strip() == SCRIPT.strip()
