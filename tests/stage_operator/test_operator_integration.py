"""The real operator (kopf, in a thread) against the emulated Kubernetes API over HTTP; the test plays kubelet.
Where the operator probes a healthy stage, real `stage-runtime serve` processes answer at their pod IPs."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from support.operator_harness import STAGES_PATH, Cluster, manifest, operator, wait_for
from support.live_pods import live_stages, map_pod
from support.rbac import allowed

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cluster(kube_emulator, kubeconfig):
    c = Cluster(kube_emulator)
    yield c
    c.close()


def ready(cluster: Cluster, name: str, replicas: int, generation: int = 1) -> bool:
    s = cluster.status(name)
    return (s.get('phase') == 'Ready' and s.get('readyReplicas') == replicas and s.get('replicas') == replicas
            and s.get('observedGeneration') == generation)


def test_apply_creates_children_and_reaches_ready(cluster, kube_emulator):
    sample = yaml.safe_load((ROOT / 'manifests' / 'samples' / 'tiny-cpu.yaml').read_text())
    with operator(kube_emulator):
        created = cluster.apply(sample)
        uid = created['metadata']['uid']
        pods = wait_for(lambda: len(cluster.pods('tiny')) == 2 and cluster.pods('tiny'), what='two pods')
        assert set(pods) == {'tiny-0', 'tiny-1'}
        for pod in pods.values():
            assert pod['metadata']['ownerReferences'][0]['uid'] == uid
            assert pod['spec']['restartPolicy'] == 'Never'
        service = kube_emulator.get('services', 'tiny')
        assert service['metadata']['ownerReferences'][0]['uid'] == uid
        assert service['spec']['selector'] == {'diffstage.io/stage': 'tiny', 'diffstage.io/serving': 'true'}
        assert kube_emulator.get('configmaps', 'tiny-config')['metadata']['ownerReferences'][0]['uid'] == uid
        policy = kube_emulator.get('networkpolicies', 'tiny')
        assert policy['metadata']['ownerReferences'][0]['uid'] == uid
        assert policy['spec']['podSelector'] == {'matchLabels': {'diffstage.io/stage': 'tiny'}}
        wait_for(lambda: cluster.status('tiny').get('phase') == 'Progressing', what='Progressing')
        cluster.all_ready('tiny')
        wait_for(lambda: ready(cluster, 'tiny', 2), what='Ready 2/2')
        status = cluster.status('tiny')
        assert status['selector'] == 'diffstage.io/stage=tiny'
        assert status['topology']['worldSize'] == 2
        assert cluster.condition('tiny', 'Ready')['status'] == 'True'
        assert all(c['observedGeneration'] == 1 for c in status['conditions'])
        assert [r['pod'] for r in status['replicaStatuses']] == ['tiny-0', 'tiny-1']


def unchanged_reconciles() -> float:
    from prometheus_client import REGISTRY
    return REGISTRY.get_sample_value('diffstage_operator_reconciles_total', {'result': 'unchanged'}) or 0.0


def resyncs(count: int, timeout: float = 20) -> None:
    """Wait until `count` more reconciles found nothing to do."""
    start = unchanged_reconciles()
    wait_for(lambda: unchanged_reconciles() >= start + count, timeout, what=f'{count} idle reconciles')


def test_scale_up_and_down(cluster, kube_emulator, tiny_sd_path, tmp_path):
    with live_stages(tiny_sd_path, tmp_path, 3) as (zero, one, two), operator(kube_emulator):
        # real one-rank stages answer the operator's probes (idle) at their pod IPs: fenced, then deleted once a
        # probe after the fence saw nothing in flight
        cluster.apply(manifest('tiny', parallel={}, resources={'gpusPerPod': 1, 'gpuResourceName': ''},
                               healthCheck={'periodSeconds': 0.25}))
        wait_for(lambda: len(cluster.pods('tiny')) == 2, what='two pods')
        map_pod(cluster, 'tiny-0', zero.http_url)
        map_pod(cluster, 'tiny-1', one.http_url)
        wait_for(lambda: ready(cluster, 'tiny', 2), what='Ready 2/2')
        cluster.scale('tiny', 3)
        wait_for(lambda: set(cluster.pods('tiny')) == {'tiny-0', 'tiny-1', 'tiny-2'}, what='a third pod')
        wait_for(lambda: cluster.condition('tiny', 'Progressing').get('status') == 'True', what='Progressing')
        assert cluster.status('tiny')['phase'] == 'Progressing'
        map_pod(cluster, 'tiny-2', two.http_url)
        wait_for(lambda: ready(cluster, 'tiny', 3, generation=2) and all(  # victims go by measured load:
            r.get('health') == 'Healthy' for r in cluster.status('tiny')['replicaStatuses']), what='Ready 3/3, probed')
        cluster.scale('tiny', 1)  # all idle: the highest indices go
        wait_for(lambda: set(cluster.pods('tiny')) == {'tiny-0'}, what='one pod left')
        writes = [(verb, name) for verb, plural, _, name, sub in kube_emulator.mutations if plural == 'pods' and not sub]
        for name in ('tiny-1', 'tiny-2'):  # out of the Service (the fence is a patch) before it was deleted
            assert writes.index(('patch', name)) < writes.index(('delete', name)), writes
        wait_for(lambda: ready(cluster, 'tiny', 1, generation=3), what='Ready 1/1')
        assert [r['index'] for r in cluster.status('tiny')['replicaStatuses']] == [0]


def test_spec_change_rolls_one_pod_at_a_time(cluster, kube_emulator):
    with operator(kube_emulator):
        cluster.apply(manifest('tiny', replicas=3))
        wait_for(lambda: len(cluster.pods('tiny')) == 3, what='three pods')
        cluster.all_ready('tiny')
        wait_for(lambda: ready(cluster, 'tiny', 3), what='Ready 3/3')
        old_hash = cluster.status('tiny')['templateHash']
        cluster.patch_spec('tiny', {'engine': {'executionMode': 'step', 'maxNumSeqs': 8}})
        new_hash = wait_for(lambda: cluster.status('tiny').get('observedGeneration') == 2
                            and cluster.status('tiny')['templateHash'], what='the new template hash')
        assert new_hash != old_hash
        for step in range(3):
            fresh = wait_for(lambda: [n for n, p in cluster.pods('tiny').items() if
                                      p['metadata']['labels']['diffstage.io/template-hash'] == new_hash
                                      and not any(c['type'] == 'Ready' and c['status'] == 'True'
                                                  for c in p['status'].get('conditions', ()))],
                             what=f'replacement pod {step + 1}')
            resyncs(2)  # give the operator every chance to take down more than one
            pods = cluster.pods('tiny')
            old = [n for n, p in pods.items() if p['metadata']['labels']['diffstage.io/template-hash'] == old_hash]
            assert len(fresh) == 1 and len(old) == 2 - step, (fresh, old)
            reason = cluster.condition('tiny', 'Progressing')['reason']
            assert reason == ('RollingUpdate' if step < 2 else 'ReplicasStarting')  # the last old pod is gone
            assert '--max-num-seqs' in pods[fresh[0]]['spec']['containers'][0]['command']
            cluster.kubelet_ready(fresh[0])
        wait_for(lambda: ready(cluster, 'tiny', 3, generation=2), what='Ready 3/3 at generation 2')
        assert cluster.status('tiny')['updatedReplicas'] == 3


def test_gpus_exceeding_every_node_create_nothing(cluster, kube_emulator):
    cluster.add_gpu_node('gpu-small', 2)
    cluster.add_gpu_node('gpu-big', 4)
    with operator(kube_emulator):
        cluster.apply(manifest('big', replicas=1, parallel={'tensorParallelSize': 8, 'ulyssesDegree': 1},
                               resources={'gpusPerPod': 8, 'gpuResourceName': 'nvidia.com/gpu'}))
        accepted = wait_for(lambda: cluster.condition('big', 'Accepted'), what='Accepted')
        assert accepted['status'] == 'False' and accepted['reason'] == 'InsufficientGPUCapacity'
        assert 'gpusPerPod=8 of nvidia.com/gpu' in accepted['message'] and 'gpu-big with 4' in accepted['message']
        assert cluster.status('big')['phase'] == 'Pending'
        warnings = wait_for(lambda: [e for e in kube_emulator.objects('events')  # posted after the status write
                                     if e['reason'] == 'InsufficientGPUCapacity'], what='the Warning event')
        assert len(warnings) == 1 and warnings[0]['involvedObject']['name'] == 'big'
        resyncs(2)
        assert cluster.pods('big') == {} and kube_emulator.get('services', 'big') is None
        assert kube_emulator.get('configmaps', 'big-config') is None
        cluster.add_gpu_node('gpu-huge', 8)  # a node watch event: the operator re-checks
        wait_for(lambda: cluster.pods('big'), what='a pod once a node fits')
        pod = cluster.pods('big')['big-0']
        assert pod['spec']['containers'][0]['resources']['limits'] == {'nvidia.com/gpu': '8'}
        wait_for(lambda: cluster.condition('big', 'Accepted').get('status') == 'True', what='Accepted=True')


def test_unschedulable_pods_wait_for_gpus_and_failed_pods_degrade(cluster, kube_emulator):
    cluster.add_gpu_node('gpu-1', 2)
    with operator(kube_emulator):
        cluster.apply(manifest('g', parallel={'cfgParallelSize': 2},
                               resources={'gpusPerPod': 2, 'gpuResourceName': 'nvidia.com/gpu'}))
        wait_for(lambda: len(cluster.pods('g')) == 2, what='two pods')
        cluster.kubelet_ready('g-0')
        cluster.scheduler_unschedulable('g-1', '0/1 nodes are available: 1 Insufficient nvidia.com/gpu.')
        progressing = wait_for(lambda: cluster.condition('g', 'Progressing').get('reason') == 'WaitingForGPUs'
                               and cluster.condition('g', 'Progressing'), what='WaitingForGPUs')
        assert progressing['status'] == 'True' and 'g-1' in progressing['message']
        assert cluster.condition('g', 'Degraded')['status'] == 'False'
        assert cluster.status('g')['phase'] == 'Progressing'
        cluster.kubelet_failed('g-0', 3, 'WorkerDied: rank 1 (pid 4242) killed by signal 9')
        degraded = wait_for(lambda: cluster.condition('g', 'Degraded').get('status') == 'True'
                            and cluster.condition('g', 'Degraded'), what='Degraded')
        assert degraded['reason'] == 'ReplicaFailed'
        assert 'g-0: WorkerDied (exit code 3): rank 1 (pid 4242) killed by signal 9' in degraded['message']
        failure = cluster.status('g')['replicaStatuses'][0]['lastFailure']
        assert failure == {'reason': 'WorkerDied', 'message': 'rank 1 (pid 4242) killed by signal 9', 'exitCode': 3,
                           'time': '2026-01-01T00:01:00Z'}
        assert cluster.status('g')['phase'] == 'Degraded'
        assert 'g-0' in cluster.pods('g'), 'recreated only after the restart backoff (10 s by default)'


def test_delete_leaves_nothing_behind(cluster, kube_emulator):
    with operator(kube_emulator):
        cluster.apply(manifest('tiny'))
        wait_for(lambda: len(cluster.pods('tiny')) == 2, what='two pods')
        wait_for(lambda: cluster.status('tiny').get('phase'), what='a status')
        cluster.delete('tiny')
        wait_for(lambda: cluster.stage('tiny') is None, what='the stage to go')
        assert cluster.pods('tiny') == {}
        assert kube_emulator.get('services', 'tiny') is None and kube_emulator.get('configmaps', 'tiny-config') is None
        assert kube_emulator.get('poddisruptionbudgets', 'tiny') is None, 'the PDB goes with its stage'
        assert kube_emulator.get('networkpolicies', 'tiny') is None, 'garbage-collected with the stage'


def test_the_stage_owns_a_pod_disruption_budget(cluster, kube_emulator):
    with operator(kube_emulator):
        uid = cluster.apply(manifest('tiny', replicas=3))['metadata']['uid']
        pdb = wait_for(lambda: kube_emulator.get('poddisruptionbudgets', 'tiny'), what='the PDB')
        assert pdb['metadata']['ownerReferences'][0]['uid'] == uid and pdb['metadata']['ownerReferences'][0]['controller']
        assert pdb['spec']['maxUnavailable'] == 1
        assert pdb['spec']['selector'] == {'matchLabels': {'diffstage.io/stage': 'tiny', 'diffstage.io/serving': 'true'}}
        cluster.patch_spec('tiny', {'disruption': {'maxUnavailable': 2}})
        wait_for(lambda: kube_emulator.get('poddisruptionbudgets', 'tiny')['spec']['maxUnavailable'] == 2,
                 what='the budget follows the spec')
        cluster.patch_spec('tiny', {'replicas': 1, 'disruption': None})  # one replica: a budget would block drains
        wait_for(lambda: kube_emulator.get('poddisruptionbudgets', 'tiny') is None, what='the PDB removed')


def test_the_eviction_api_honours_the_budget_and_an_evicted_pod_is_replaced_at_once(cluster, kube_emulator):
    """What `kubectl drain` does: POST pods/<name>/eviction. The PDB (maxUnavailable 1) admits one eviction and
    refuses a second while the first replacement is not ready; the evicted replica is back at once, uncounted."""
    evict = lambda pod: cluster.http.post(f'/api/v1/namespaces/default/pods/{pod}/eviction', json={  # noqa: E731
        'apiVersion': 'policy/v1', 'kind': 'Eviction', 'metadata': {'name': pod, 'namespace': 'default'}})
    with operator(kube_emulator):
        cluster.apply(manifest('tiny', replicas=3, restartPolicy={'backoffInitialSeconds': 300,
                                                                  'backoffMaxSeconds': 300}))
        wait_for(lambda: len(cluster.pods('tiny')) == 3, what='three pods')
        cluster.all_ready('tiny')
        wait_for(lambda: ready(cluster, 'tiny', 3) and kube_emulator.get('poddisruptionbudgets', 'tiny'),
                 what='Ready 3/3 with its PDB')
        old_uid = cluster.pods('tiny')['tiny-0']['metadata']['uid']
        assert evict('tiny-0').status_code == 201
        wait_for(lambda: cluster.pods('tiny').get('tiny-0', {}).get('metadata', {}).get('uid') not in (None, old_uid),
                 what='tiny-0 recreated at once')
        refused = evict('tiny-1')  # the new tiny-0 is not ready yet: a second eviction would break the budget
        assert refused.status_code == 429 and "violate the pod's disruption budget tiny" in refused.json()['message']
        assert 'tiny-1' in cluster.pods('tiny')
        cluster.kubelet_ready('tiny-0')
        wait_for(lambda: ready(cluster, 'tiny', 3), what='Ready 3/3 again')
        assert evict('tiny-1').status_code == 201
        assert cluster.status('tiny')['restarts']['total'] == 0


def test_an_evicted_pod_is_replaced_at_once_without_a_restart(cluster, kube_emulator):
    with operator(kube_emulator):
        cluster.apply(manifest('tiny', restartPolicy={'backoffInitialSeconds': 300, 'backoffMaxSeconds': 300}))
        wait_for(lambda: len(cluster.pods('tiny')) == 2, what='two pods')
        cluster.all_ready('tiny')
        wait_for(lambda: ready(cluster, 'tiny', 2), what='Ready 2/2')
        old_uid = cluster.pods('tiny')['tiny-0']['metadata']['uid']
        cluster.pod_status('tiny-0', {  # the kubelet evicts it under memory pressure
            'phase': 'Failed', 'reason': 'Evicted', 'message': 'The node was low on resource: memory.',
            'conditions': [{'type': 'DisruptionTarget', 'status': 'True', 'reason': 'TerminationByKubelet',
                            'message': 'The node was low on resource: memory.'}]})
        wait_for(lambda: cluster.pods('tiny').get('tiny-0', {}).get('metadata', {}).get('uid') not in (None, old_uid),
                 what='a new tiny-0 (no 300 s backoff)')
        replica = wait_for(lambda: next((r for r in cluster.status('tiny')['replicaStatuses']
                                         if r['index'] == 0 and r.get('lastFailure')), None), what='why, in status')
        assert replica['lastFailure']['reason'] == 'Evicted' and replica['restarts'] == 0
        assert cluster.status('tiny')['restarts']['total'] == 0
        wait_for(lambda: [e for e in kube_emulator.objects('events') if e['reason'] == 'ReplicaEvicted'],
                 what='the ReplicaEvicted Event')  # posted after the status write


def test_invalid_topology_is_refused_by_the_api_and_not_accepted_by_the_operator(cluster, kube_emulator):
    """The API server refuses it (the CRD's CEL rule); one that got in anyway (stored before the rule existed:
    seeded past admission here) is caught by the operator's own check, through stage_runtime.config."""
    bad = manifest('bad', parallel={'cfgParallelSize': 2}, resources={'gpusPerPod': 3, 'gpuResourceName': ''})
    refused = cluster.http.post(STAGES_PATH, json=bad)
    assert refused.status_code == 422 and 'but resources.gpusPerPod is 3' in refused.json()['message']
    with operator(kube_emulator):
        kube_emulator.seed('dstage', bad)
        accepted = wait_for(lambda: cluster.condition('bad', 'Accepted'), what='Accepted')
        assert accepted['status'] == 'False' and accepted['reason'] == 'InvalidSpec'
        assert 'num_gpus=3 is not divisible' in accepted['message']
        assert cluster.status('bad')['phase'] == 'Stalled' and cluster.condition('bad', 'Stalled')['status'] == 'True'
        assert cluster.pods('bad') == {}


@pytest.mark.parametrize('stages', [1, 50])
def test_resync_after_ready_makes_zero_mutating_calls(cluster, kube_emulator, stages):
    resync = 0.5 if stages == 1 else 1.5  # 2 cores, shared
    names = [f's{i}' for i in range(stages)]
    with operator(kube_emulator, '--namespace=default', '--standalone', f'--resync-seconds={resync}'):
        for name in names:
            cluster.apply(manifest(name, replicas=1, parallel={}, resources={'gpusPerPod': 1, 'gpuResourceName': ''},
                                   disruption={'maxUnavailable': 1}))  # asked for: a PDB on one replica
        wait_for(lambda: len(kube_emulator.objects('pods')) == stages, timeout=60, what='all pods')
        wait_for(lambda: len(kube_emulator.objects('poddisruptionbudgets')) == stages, timeout=60, what='all PDBs')
        for name in names:
            cluster.kubelet_ready(f'{name}-0')
        wait_for(lambda: all(ready(cluster, n, 1) for n in names), timeout=60, what='every stage Ready')
        resyncs(stages)  # let the last status writes settle
        kube_emulator.reset_counts()
        resyncs(2 * stages)
        assert kube_emulator.mutation_count == 0, kube_emulator.mutations[:20]


def _verb(request) -> str:
    method = request.method.value
    if method == 'GET':
        return 'watch' if request.params.get('watch') in ('true', '1') else 'get' if request.name else 'list'
    return {'POST': 'create', 'PATCH': 'patch', 'PUT': 'update', 'DELETE': 'delete'}[method]


def test_cluster_wide_with_peering_uses_only_what_rbac_grants(cluster, kube_emulator):
    """The deployed mode (--all-namespaces --peering); every API call the operator made is in rbac.yaml."""
    kube_emulator.seed('clusterkopfpeerings', {'metadata': {'name': 'diffstage'}})
    cluster.add_gpu_node('gpu-1', 4)
    with operator(kube_emulator, '--all-namespaces', '--peering=diffstage'):
        cluster.apply(manifest('g', parallel={'cfgParallelSize': 2},
                               resources={'gpusPerPod': 2, 'gpuResourceName': 'nvidia.com/gpu'}))
        wait_for(lambda: len(cluster.pods('g')) == 2, what='two pods')
        cluster.all_ready('g')
        wait_for(lambda: ready(cluster, 'g', 2), what='Ready')
        cluster.kubelet_failed('g-1', 3, 'WorkerDied: worker rank 1 (pid 9) killed by signal 9')  # fenced: a patch
        wait_for(lambda: cluster.pods('g')['g-1']['metadata']['labels']['diffstage.io/serving'] == 'false',
                 what='the failed pod fenced')
        cluster.patch_spec('g', {'replicas': 1, 'engine': {'maxNumSeqs': 2}})
        wait_for(lambda: cluster.status('g').get('observedGeneration') == 2 and len(cluster.pods('g')) == 1
                 and cluster.pods('g')['g-0']['metadata']['labels']['diffstage.io/template-hash']
                 == cluster.status('g')['templateHash'], what='scaled down and rolled')
        cluster.delete('g')
        wait_for(lambda: cluster.stage('g') is None, what='deleted')
    operator_calls = {(r.resource.group, r.resource.plural + (f'/{r.subresource}' if r.subresource else ''), _verb(r))
                      for r in kube_emulator._requests if r.resource is not None and r.resource.plural
                      and not r.headers.get('User-Agent', '').startswith('python-httpx')}
    assert ('', 'pods', 'create') in operator_calls and ('', 'pods', 'patch') in operator_calls
    assert ('diffstage.io', 'diffusionstages/status', 'patch') in operator_calls
    denied = sorted(call for call in operator_calls if not allowed(*call))
    assert denied == [], f'calls the ClusterRole does not grant: {denied}'


def test_api_errors_are_retried_with_backoff(cluster, kube_emulator):
    import kmock
    from prometheus_client import REGISTRY

    errors_before = REGISTRY.get_sample_value('diffstage_operator_reconcile_errors_total') or 0.0
    kube_emulator['post', kmock.resource('v1/pods')][:2] << 503  # the first two pod creations fail
    with operator(kube_emulator) as runner:
        cluster.apply(manifest('tiny'))
        wait_for(lambda: len(cluster.pods('tiny')) == 2, what='both pods despite the failures')
        cluster.all_ready('tiny')
        wait_for(lambda: ready(cluster, 'tiny', 2), what='Ready')
    assert 'reconcile failed (retry in 1.0s): POST /api/v1/namespaces/default/pods answered 503' in runner.output
    assert (REGISTRY.get_sample_value('diffstage_operator_reconcile_errors_total') or 0.0) >= errors_before + 2


def test_a_restarted_operator_picks_up_where_the_cluster_is(cluster, kube_emulator):
    """Level-based: no memory across restarts is needed; changes made while it was down are reconciled."""
    with operator(kube_emulator):
        cluster.apply(manifest('tiny'))
        wait_for(lambda: len(cluster.pods('tiny')) == 2, what='two pods')
        cluster.all_ready('tiny')
        wait_for(lambda: ready(cluster, 'tiny', 2), what='Ready')
    cluster.scale('tiny', 3)  # while no operator runs
    kube_emulator.reset_counts()
    with operator(kube_emulator):
        wait_for(lambda: len(cluster.pods('tiny')) == 3, what='the third pod')
        cluster.kubelet_ready('tiny-2')
        wait_for(lambda: ready(cluster, 'tiny', 3, generation=2), what='Ready 3/3')
    pod_creates = [m for m in kube_emulator.mutations if m[:2] == ('create', 'pods')]
    assert pod_creates == [('create', 'pods', 'default', None, None)], 'exactly one pod created, none re-created'


def test_a_pod_refused_by_a_resource_quota_waits_for_quota_then_starts(cluster, kube_emulator):
    """The ResourceQuota admission plugin refuses a create with 403 `exceeded quota`: the operator reports
    Progressing/WaitingForQuota with the API's words, counts no restart, and creates the pod once quota frees."""
    import kmock

    quota = {'full': True}

    def resource_quota(plural, obj):
        if plural == 'pods' and obj['metadata']['name'] == 'q-1' and quota['full']:
            raise kmock.KubernetesError(status=403, reason='Forbidden', message=(
                'pods "q-1" is forbidden: exceeded quota: gpu-quota, requested: requests.nvidia.com/gpu=1, '
                'used: requests.nvidia.com/gpu=1, limited: requests.nvidia.com/gpu=1'))
        return obj

    kube_emulator.webhooks.append(resource_quota)
    with operator(kube_emulator):
        cluster.apply(manifest('q', parallel={}, resources={'gpusPerPod': 1, 'gpuResourceName': ''}))
        wait_for(lambda: 'q-0' in cluster.pods('q'), what='the pod that fits')
        cluster.kubelet_ready('q-0')
        waiting = wait_for(lambda: (c := cluster.condition('q', 'Progressing')).get('reason') == 'WaitingForQuota'
                           and c, what='WaitingForQuota')
        assert waiting['status'] == 'True' and 'q-1: pods "q-1" is forbidden: exceeded quota: gpu-quota' \
            in waiting['message']
        assert list(cluster.pods('q')) == ['q-0'] and cluster.status('q')['restarts']['total'] == 0
        quota['full'] = False  # another workload ended
        wait_for(lambda: 'q-1' in cluster.pods('q'), what='the refused pod, created on a retry')
        cluster.kubelet_ready('q-1')
        wait_for(lambda: ready(cluster, 'q', 2), what='Ready 2/2')
        assert cluster.condition('q', 'Progressing')['reason'] == 'Complete'
