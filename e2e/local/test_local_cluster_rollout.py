"""Tier 4: no request lost to any removal, least-loaded victims, a surge rollout, an automatic rollback and the
PodDisruptionBudget, on the embedded local cluster (the emulated API, the operator as a process, every pod as
real `stage-runtime serve` processes) under steady load through the Service (e2e/local/load.py).

One cluster serves the module; a fixture gives each test the stage `roll` (replicas of one CPU rank) as the
test needs it and Ready, whatever the test before it left (applied again after a deletion, its spec patched
back, scaled to the count): `three` is SPEC with 3 replicas, `two` SPEC with 2, `rolled_two` ROLLED (SPEC after
the surge rollout) with 2. So each test stands alone in any order, and in the file's order no test starts a pod
only for the next to remove it: 3→1 in mode None with the busiest replica the highest index; 3→1 through /scale
(as an HPA) in mode External with the busiest in the middle; a rolling update with maxSurge 1 (SPEC → ROLLED);
a rollout from ROLLED to a config that exits 2, rolled back; the PDB, and the stage's deletion through the drain.
"""
from __future__ import annotations

import sys
import threading

import httpx
import pytest

from e2e import scenario
from e2e.local.cluster import LocalCluster
from e2e.local.load import Load
from e2e.local.pod_process import group_members

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith('linux'),
                       reason='the local pod runner gives each pod a 127.x.y.z address and reads /proc: Linux only'),
    pytest.mark.timeout(300),
]
ROLL = 'roll'
CLAIM = 'tiny-sd'
# The tiny SD pipeline built once for the module on a bound claim: a pod starts without the `make-model` init
# container (a builtin model builds it in every pod: ~10 s of each start under load, about ten starts here).
SPEC = {'model': {'source': {'pvc': {'claimName': CLAIM}}}, 'replicas': 3, 'parallel': {},
        'resources': {'gpusPerPod': 1, 'gpuResourceName': ''}, 'engine': {'executionMode': 'step', 'maxNumSeqs': 4},
        'healthCheck': {'periodSeconds': 0.5, 'timeoutSeconds': 10, 'failureThreshold': 20}}  # 2 loaded cores


@pytest.fixture(scope='module')
def cluster(tmp_path_factory):
    from stage_runtime.models.tiny import make_tiny_model

    claim = make_tiny_model(tmp_path_factory.mktemp('claim') / 'tiny-sd', kind='sd', seed=0)
    with LocalCluster(tmp_path_factory.mktemp('local-cluster-rollout')) as local:
        local.runner.sources.claims[CLAIM] = claim                        # the node's bound volume
        yield local
    assert local.operator.returncode == 0, local.operator_log[-3000:]
    assert 'Traceback' not in local.operator_log, local.operator_log[-5000:]
    assert not local.runner.errors, local.runner.errors


SURGE = {'rollout': {'maxSurge': 1, 'maxUnavailable': 0}, 'engine': {'executionMode': 'step', 'maxNumSeqs': 2}}
ROLLED = {**SPEC, **SURGE}  # what the surge rollout's patch makes of SPEC


def at(cluster, spec: dict, replicas: int) -> None:
    """The stage as `spec` says with `replicas`, Ready, every pod at the current revision."""
    manifest = {'apiVersion': 'diffstage.io/v1alpha1', 'kind': 'DiffusionStage', 'metadata': {'name': ROLL},
                'spec': {**spec, 'replicas': replicas}}
    scenario.restore(cluster, manifest, timeout=240)
    scenario.wait_for(lambda: all_at_current_revision(cluster), 60, 'every pod at the current revision',
                      lambda: sorted(pods(cluster)))


@pytest.fixture
def three(cluster):
    at(cluster, SPEC, 3)


@pytest.fixture
def two(cluster):
    at(cluster, SPEC, 2)


@pytest.fixture
def rolled_two(cluster):
    at(cluster, ROLLED, 2)


def all_at_current_revision(cluster) -> bool:
    current = scenario.status(cluster, ROLL).get('templateHash')
    return all(p['metadata']['labels']['diffstage.io/template-hash'] == current for p in pods(cluster).values())


def pods(cluster) -> dict[str, dict]:
    return {p['metadata']['name']: p for p in cluster.pods(ROLL) if not p['metadata'].get('deletionTimestamp')}


class Busy:
    """`count` long requests sent straight to one pod (not through the Service): the replica with the most load."""

    def __init__(self, cluster, pod: str, count: int = 2, steps: int = 150):
        self.url = f"http://{pods(cluster)[pod]['status']['podIP']}:8000"
        self.codes: list[int] = []
        self.threads = [threading.Thread(target=self._one, args=(f'busy-{pod}-{i}', steps), daemon=True)
                        for i in range(count)]
        for t in self.threads:
            t.start()

    def _one(self, request_id: str, steps: int) -> None:
        response = httpx.post(f'{self.url}/v1/images/generations', timeout=240, json={
            'prompt': 'busy', 'size': '64x64', 'num_inference_steps': steps, 'request_id': request_id})
        self.codes.append(response.status_code)

    def join(self) -> list[int]:
        for t in self.threads:
            t.join(240)
        return self.codes


def seen_busy(cluster, pod: str, count: int) -> bool:
    """The operator's own probe saw `count` requests in flight on the pod (what it picks victims by)."""
    replica = next((r for r in scenario.status(cluster, ROLL).get('replicaStatuses') or () if r['pod'] == pod), {})
    return (replica.get('waiting') or 0) + (replica.get('running') or 0) >= count


def deleted_pods(cluster) -> list[str]:
    """Every pod delete the API served, in order."""
    return [name for verb, plural, _, name, sub in cluster.emulator.mutations
            if verb == 'delete' and plural == 'pods' and not sub]


def scale_down_to_one_keeping(cluster, busy_index: int, scale) -> None:
    names = sorted(pods(cluster), key=lambda name: int(name.rsplit('-', 1)[1]))
    assert len(names) == 3, names
    busy_pod = names[busy_index]
    before = len(deleted_pods(cluster))
    busy = Busy(cluster, busy_pod)
    probed = lambda: all(r.get('health') == 'Healthy' and 'running' in r  # noqa: E731 (victims go by measured load)
                         for r in scenario.status(cluster, ROLL).get('replicaStatuses') or ())
    scenario.wait_for(lambda: seen_busy(cluster, busy_pod, 2) and probed(), 60,
                      f'the probe to see the load on {busy_pod}',
                      lambda: scenario.status(cluster, ROLL).get('replicaStatuses'))
    with Load(cluster, ROLL) as load:
        scale(1)
        scenario.wait_for(lambda: set(pods(cluster)) == {busy_pod}, 120, f'only {busy_pod} left',
                          lambda: sorted(pods(cluster)))
        served = load.answers
        scenario.wait_for(lambda: load.answers >= served + 2, 120, 'the Service to keep answering')
    assert busy.join() == [200, 200], 'the busy replica kept serving its requests'
    assert load.answers >= 3 and not load.failures, (load.answers, load.failures[:5])
    gone = deleted_pods(cluster)[before:]
    assert sorted(gone) == sorted(set(names) - {busy_pod}), gone  # the least loaded went
    scenario.wait_ready(cluster, ROLL, 1, timeout=60)


@pytest.mark.usefixtures('three')
def test_a_scale_down_in_mode_none_removes_the_least_loaded_and_loses_no_request(cluster):
    scale_down_to_one_keeping(cluster, 2, lambda n: cluster.patch_spec(ROLL, {'replicas': n}))  # the highest index


@pytest.mark.usefixtures('three')
def test_a_scale_down_in_mode_external_removes_the_least_loaded_and_loses_no_request(cluster):
    cluster.patch_spec(ROLL, {'autoscaling': {'mode': 'External'}})
    scenario.wait_ready(cluster, ROLL, 3, timeout=240)
    scale_down_to_one_keeping(cluster, 1, lambda n: cluster.scale(ROLL, n))  # through /scale, as an HPA or KEDA does


@pytest.mark.usefixtures('two')
def test_a_surge_rollout_under_load_loses_no_request(cluster):
    old_hash = scenario.status(cluster, ROLL)['templateHash']
    most = []
    with Load(cluster, ROLL) as load:
        cluster.patch_spec(ROLL, SURGE)

        def rolled() -> bool:
            most.append(len(pods(cluster)))
            st = scenario.status(cluster, ROLL)
            return st.get('templateHash') != old_hash and scenario.is_ready(cluster, ROLL, 2) and all(
                p['metadata']['labels']['diffstage.io/template-hash'] == st['templateHash']
                for p in pods(cluster).values())

        scenario.wait_for(rolled, 240, 'the rollout to finish', lambda: scenario.status(cluster, ROLL))
    assert load.answers >= 3 and not load.failures, (load.answers, load.failures[:5])
    assert max(most) == 3, 'one surge pod, never more (replicas 2 + maxSurge 1)'
    rollout = scenario.status(cluster, ROLL)['rollout']
    assert rollout['stableRevision'] == rollout['currentRevision'] == scenario.status(cluster, ROLL)['templateHash']
    assert old_hash in [r['revision'] for r in rollout['revisions']]


@pytest.mark.usefixtures('rolled_two')
def test_a_rollout_to_a_config_that_exits_2_rolls_back_and_keeps_serving(cluster):
    before = scenario.status(cluster, ROLL)
    good_hash, restarts = before['templateHash'], before['restarts']['total']
    config = cluster.api.get(f'/api/v1/namespaces/default/configmaps/{ROLL}-config').json()['data']
    created = len([m for m in cluster.emulator.mutations if m[0] == 'create' and m[1] == 'pods'])
    with Load(cluster, ROLL) as load:
        cluster.patch_spec(ROLL, {'engine': {'executionMode': 'step', 'maxNumSeqs': 2,  # ROLLED's surge rollout
                                             'extraArgs': ['--cfg-parallel-size', '2']}})  # 2 ranks on 1: exit 2
        degraded = scenario.wait_for(
            lambda: (c := scenario.condition(cluster, ROLL, 'Degraded')).get('reason') == 'RolloutFailed' and c,
            240, 'RolloutFailed', lambda: scenario.status(cluster, ROLL))
        scenario.wait_for(lambda: len(pods(cluster)) == 2 and all(
            p['metadata']['labels']['diffstage.io/template-hash'] == good_hash for p in pods(cluster).values()), 60,
            'only the old revision left', lambda: sorted(pods(cluster)))
    assert load.answers >= 3 and not load.failures, (load.answers, load.failures[:5])
    assert 'cfg_parallel_size(2)' in degraded['message'] and '(exit code 2)' in degraded['message'], degraded
    # The status follows the pods at the operator's next reconcile: a busy machine can show the moment in between.
    status = scenario.wait_for(lambda: (st := scenario.status(cluster, ROLL)).get('readyReplicas') == 2 and st, 60,
                               'both old pods ready in the status', lambda: scenario.status(cluster, ROLL))
    assert status['phase'] == 'Degraded'
    assert status['rollout']['currentRevision'] == good_hash != status['rollout']['failedRevision']['revision']
    assert status['restarts']['total'] == restarts, 'the restart budget is untouched'
    assert scenario.condition(cluster, ROLL, 'Stalled')['status'] == 'False'
    new_pods = len([m for m in cluster.emulator.mutations if m[0] == 'create' and m[1] == 'pods']) - created
    assert new_pods == 1, 'halted after the first new pod'
    assert cluster.api.get(f'/api/v1/namespaces/default/configmaps/{ROLL}-config').json()['data'] == config
    for pod in pods(cluster).values():  # serving with the old pods' config
        assert pod['spec']['containers'][0]['command'][-2:] != ['--cfg-parallel-size', '2']
    scenario.generate(cluster, ROLL)


@pytest.mark.usefixtures('rolled_two')  # a PDB from 2 replicas on
def test_the_pdb_is_owned_and_the_deletion_drains_and_leaves_nothing(cluster):
    uid = cluster.stage(ROLL)['metadata']['uid']
    pdb = cluster.api.get(f'/apis/policy/v1/namespaces/default/poddisruptionbudgets/{ROLL}').json()
    assert pdb['metadata']['ownerReferences'][0]['uid'] == uid and pdb['spec']['maxUnavailable'] == 1
    scenario.delete(cluster, ROLL, 60)
    assert cluster.api.get(f'/apis/policy/v1/namespaces/default/poddisruptionbudgets/{ROLL}').status_code == 404
    scenario.wait_for(lambda: not cluster.runner.running(), 60, 'every pod process to stop', cluster.runner.running)
    assert not cluster.runner.leftovers, cluster.runner.leftovers
    assert not group_members(cluster.runner.all_groups), 'no process of any pod is left'
