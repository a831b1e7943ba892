"""Tier 4, the test playing Kueue on the embedded local cluster: a mutating webhook gates every new pod that
carries `kueue.x-k8s.io/queue-name` (as Kueue's pod integration does), the pod runner leaves a gated pod
Pending (PodScheduled=False SchedulingGated, as the scheduler reports it), the stage says
Progressing/WaitingForQuota with no restart counted; removing the gate ("admitted") lets the pod run and the
stage becomes Ready and serves an image. The podTemplate's labels, annotations and scheduler fields reach the
pod through the real operator."""
from __future__ import annotations

import sys

import pytest

from e2e import scenario
from e2e.local.cluster import LocalCluster

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith('linux'),
                       reason='the local pod runner gives each pod a 127.x.y.z address and reads /proc: Linux only'),
    pytest.mark.timeout(240),
]
QUEUE = 'kueue.x-k8s.io/queue-name'
GATE = 'kueue.x-k8s.io/admission'


def kueue(plural: str, obj: dict) -> dict:
    """Kueue's webhook, played: a pod with a queue name is created gated until its workload is admitted."""
    if plural == 'pods' and QUEUE in ((obj.get('metadata') or {}).get('labels') or {}):
        obj.setdefault('spec', {}).setdefault('schedulingGates', []).append({'name': GATE})
    return obj


def test_a_gated_stage_waits_for_quota_then_serves_once_admitted(tmp_path):
    manifest = scenario.with_spec(scenario.sample(), replicas=1, parallel={},
                                  resources={'gpusPerPod': 1, 'gpuResourceName': ''},
                                  podTemplate={'labels': {QUEUE: 'team-a'},
                                               'annotations': {'example.com/owner': 'team-a'},
                                               'priorityClassName': 'inference'})
    manifest['metadata']['name'] = name = 'queued'
    with LocalCluster(tmp_path) as cluster:
        cluster.emulator.webhooks.append(kueue)
        cluster.apply(manifest)

        def waiting():
            c = scenario.condition(cluster, name, 'Progressing')
            return c if c.get('reason') == 'WaitingForQuota' else None
        progressing = scenario.wait_for(waiting, 60, 'Progressing/WaitingForQuota',
                                        lambda: scenario.status(cluster, name))
        assert progressing['status'] == 'True' and f'queued-0 ({GATE})' in progressing['message']
        [pod] = cluster.pods(name)
        assert pod['metadata']['labels'][QUEUE] == 'team-a' and pod['metadata']['labels']['diffstage.io/stage'] == name
        assert pod['metadata']['annotations'] == {'example.com/owner': 'team-a'}
        assert pod['spec']['priorityClassName'] == 'inference'
        assert pod['status']['phase'] == 'Pending'
        assert pod['status']['conditions'][0]['reason'] == 'SchedulingGated'
        assert cluster.runner.running() == [], 'a gated pod does not run'
        status = scenario.status(cluster, name)
        assert status['phase'] == 'Progressing' and status['restarts']['total'] == 0
        assert status['replicaStatuses'][0]['message'] == f'waiting for quota: scheduling gates {GATE}'

        # Kueue admits the workload: it removes the gate (the only change Kubernetes allows to the gates)
        cluster.api.patch(f'/api/v1/namespaces/default/pods/{name}-0', json={'spec': {'schedulingGates': None}},
                          headers={'Content-Type': 'application/merge-patch+json'}).raise_for_status()
        status = scenario.wait_ready(cluster, name, 1, timeout=180)
        assert status['restarts']['total'] == 0
        assert scenario.condition(cluster, name, 'Progressing')['reason'] == 'Complete'
        assert scenario.generate(cluster, name, steps=2)[:8] == b'\x89PNG\r\n\x1a\n'
        scenario.delete(cluster, name, 30)
        scenario.wait_for(lambda: not cluster.runner.running(), 60, 'every pod process to stop', cluster.runner.running)
    assert cluster.operator.returncode == 0, cluster.operator_log[-3000:]
    assert 'Traceback' not in cluster.operator_log, cluster.operator_log[-5000:]
    assert not cluster.leftovers(), cluster.leftovers()
