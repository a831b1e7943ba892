"""The `kubectl get dstage` table `make demo` prints: the CRD's printer columns, in their order."""
from __future__ import annotations

import datetime

from e2e.status_table import age, printer_columns, render

NOW = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)


def test_columns_come_from_the_crd():
    assert [c['name'] for c in printer_columns()] == ['Phase', 'Ready', 'Replicas', 'GPUs', 'Restarts', 'Age']


def test_render_a_stage_and_one_without_status():
    ready = {'metadata': {'name': 'tiny', 'creationTimestamp': '2026-01-01T11:59:00Z'},
             'spec': {'replicas': 2, 'resources': {'gpusPerPod': 2}},
             'status': {'phase': 'Ready', 'readyReplicas': 2, 'restarts': {'total': 1}, 'topology': {'gpus': 2}}}
    new = {'metadata': {'name': 'fresh-stage', 'creationTimestamp': '2026-01-01T09:00:00Z'}, 'spec': {'replicas': 1}}
    lines = render([ready, new], NOW).splitlines()
    assert lines[0].split() == ['NAME', 'PHASE', 'READY', 'REPLICAS', 'GPUS', 'RESTARTS', 'AGE']
    assert lines[1].split() == ['tiny', 'Ready', '2', '2', '2', '1', '60s']
    assert lines[2].split() == ['fresh-stage', '1', '3h']
    assert lines[1].index('Ready') == lines[0].index('PHASE'), 'aligned columns'


def test_age_like_kubectl():
    assert age('2026-01-01T11:59:59Z', NOW) == '1s'
    assert age('2026-01-01T11:58:00Z', NOW) == '2m'
    assert age('2025-12-30T12:00:00Z', NOW) == '2d'
    assert age(None, NOW) == '<unknown>'
