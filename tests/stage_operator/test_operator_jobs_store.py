"""spec.jobs against the emulated API with the real operator (kopf, in a thread): the operator reads the claim by
name; while it is missing the stage says JobsStoreMissing and has no pod; once the claim is created the operator's
re-check (PVCs are not watched) creates the pods, mounting it."""
from __future__ import annotations

import pytest
from support.operator_harness import Cluster, manifest, operator, wait_for

from stage_operator.jobs_store import RECHECK_SECONDS

CLAIM = {'metadata': {'name': 'video-jobs'},
         'spec': {'accessModes': ['ReadWriteMany'], 'resources': {'requests': {'storage': '1Gi'}}}}


@pytest.fixture
def cluster(kube_emulator, kubeconfig):
    c = Cluster(kube_emulator)
    yield c
    c.close()


def test_a_missing_claim_is_reported_then_the_pods_come_once_it_exists(cluster, kube_emulator):
    with operator(kube_emulator):
        cluster.apply(manifest('vids', jobs={'claimName': 'video-jobs', 'leaseSeconds': 12}))
        accepted = wait_for(lambda: cluster.condition('vids', 'Accepted').get('reason') == 'JobsStoreMissing'
                            and cluster.condition('vids', 'Accepted'), what='Accepted=False JobsStoreMissing')
        assert accepted['status'] == 'False' and "'video-jobs'" in accepted['message']
        assert cluster.status('vids')['phase'] == 'Pending' and cluster.pods('vids') == {}
        kube_emulator.seed('persistentvolumeclaims', CLAIM)
        pods = wait_for(lambda: len(cluster.pods('vids')) == 2 and cluster.pods('vids'),
                        timeout=RECHECK_SECONDS + 20, what='the pods once the claim exists')
        for pod in pods.values():
            volume = {'name': 'jobs-store', 'persistentVolumeClaim': {'claimName': 'video-jobs'}}
            assert volume in pod['spec']['volumes']
        assert wait_for(lambda: cluster.condition('vids', 'Accepted').get('status') == 'True', what='Accepted')


def test_an_object_stores_missing_secret_is_reported_then_the_pods_get_its_keys_once_it_exists(cluster, kube_emulator):
    jobs = {'objectStore': {'bucket': 'video-jobs', 'endpoint': 'http://minio.storage:9000',
                            'credentialsSecret': 'jobs-s3'}}
    with operator(kube_emulator):
        cluster.apply(manifest('vids', jobs=jobs))
        accepted = wait_for(lambda: cluster.condition('vids', 'Accepted').get('reason') == 'JobsStoreMissing'
                            and cluster.condition('vids', 'Accepted'), what='Accepted=False JobsStoreMissing')
        assert accepted['status'] == 'False' and "credentialsSecret 'jobs-s3'" in accepted['message']
        assert cluster.pods('vids') == {}
        kube_emulator.seed('secrets', {'metadata': {'name': 'jobs-s3'}, 'type': 'Opaque',
                                       'data': {'AWS_ACCESS_KEY_ID': 'a2V5', 'AWS_SECRET_ACCESS_KEY': 'c2VjcmV0'}})
        pods = wait_for(lambda: len(cluster.pods('vids')) == 2 and cluster.pods('vids'),
                        timeout=RECHECK_SECONDS + 20, what='the pods once the Secret exists')
        for pod in pods.values():
            env = {e['name']: e.get('valueFrom') for c in pod['spec']['containers'] for e in c.get('env', ())}
            assert env['AWS_SECRET_ACCESS_KEY'] == {'secretKeyRef': {'name': 'jobs-s3', 'key': 'AWS_SECRET_ACCESS_KEY'}}
            assert 'jobs-store' not in {v['name'] for v in pod['spec']['volumes']}
