"""A stage whose job store claim is missing: Accepted=False JobsStoreMissing naming it, no pod, a re-check; once the
claim exists the stage starts as usual (pure reconcile over what the operator observed)."""
from __future__ import annotations

import dataclasses

from stage_operator.reconcile import reconcile
from support.reconcile_world import CPU, stage, world

JOBS = {**CPU, 'jobs': {'claimName': 'video-jobs'}}
CLAIM = {'apiVersion': 'v1', 'kind': 'PersistentVolumeClaim', 'metadata': {'name': 'video-jobs', 'namespace': 'ns'},
         'spec': {'accessModes': ['ReadWriteMany']}, 'status': {'phase': 'Bound'}}


def cond(status: dict, kind: str) -> dict:
    return next(c for c in status['conditions'] if c['type'] == kind)


def test_a_missing_claim_is_a_condition_naming_it_and_no_pod_is_created():
    st = stage(JOBS)
    plan = reconcile(st, world(st, children=False))
    assert [o for o in plan.create if o['kind'] == 'Pod'] == []
    accepted = cond(plan.status, 'Accepted')
    assert (accepted['status'], accepted['reason']) == ('False', 'JobsStoreMissing')
    assert "'video-jobs'" in accepted['message'] and "namespace 'ns'" in accepted['message']
    progressing = cond(plan.status, 'Progressing')
    assert (progressing['status'], progressing['reason']) == ('False', 'JobsStoreMissing')
    assert (plan.status['phase'], plan.status['reason']) == ('Pending', 'JobsStoreMissing')
    assert plan.requeue_after is not None, 'PVCs are not watched: the stage looks again'
    assert [(e['type'], e['reason']) for e in plan.events] == [('Warning', 'JobsStoreMissing')]


def test_once_the_claim_exists_the_pods_are_created_and_mount_it():
    st = stage(JOBS)
    plan = reconcile(st, dataclasses.replace(world(st, children=False), jobs_claim=CLAIM))
    pods = [o for o in plan.create if o['kind'] == 'Pod']
    assert [p['metadata']['name'] for p in pods] == ['s-0', 's-1']
    assert all({'name': 'jobs-store', 'persistentVolumeClaim': {'claimName': 'video-jobs'}} in p['spec']['volumes']
               for p in pods)
    assert cond(plan.status, 'Accepted')['status'] == 'True'


def test_a_stage_without_jobs_never_asks_for_a_claim():
    st = stage(CPU)
    plan = reconcile(st, world(st, children=False))
    assert cond(plan.status, 'Accepted')['reason'] == 'TopologyValid'
    assert len([o for o in plan.create if o['kind'] == 'Pod']) == 2


OBJECTS = {**CPU, 'jobs': {'objectStore': {'bucket': 'video-jobs', 'prefix': 'a', 'endpoint': 'http://minio:9000',
                                            'credentialsSecret': 'jobs-s3'}, 'presignedContent': True}}
SECRET = {'apiVersion': 'v1', 'kind': 'Secret', 'metadata': {'name': 'jobs-s3', 'namespace': 'ns'}}


def test_an_object_store_whose_credentials_secret_is_missing_waits_naming_it():
    st = stage(OBJECTS)
    plan = reconcile(st, world(st, children=False))
    assert [o for o in plan.create if o['kind'] == 'Pod'] == []
    accepted = cond(plan.status, 'Accepted')
    assert (accepted['status'], accepted['reason']) == ('False', 'JobsStoreMissing')
    assert "credentialsSecret 'jobs-s3'" in accepted['message'] and plan.requeue_after is not None


def test_an_object_store_gets_the_secrets_keys_as_its_aws_environment_and_no_volume():
    st = stage(OBJECTS)
    plan = reconcile(st, dataclasses.replace(world(st, children=False), jobs_claim=SECRET))
    pods = [o for o in plan.create if o['kind'] == 'Pod']
    assert len(pods) == 2 and cond(plan.status, 'Accepted')['status'] == 'True'
    for pod in pods:
        [container] = [c for c in pod['spec']['containers'] if c['name'] == 'stage']
        env = {e['name']: e.get('valueFrom', {}).get('secretKeyRef') for e in container['env']}
        assert env['AWS_ACCESS_KEY_ID'] == {'name': 'jobs-s3', 'key': 'AWS_ACCESS_KEY_ID'}
        assert env['AWS_SECRET_ACCESS_KEY'] == {'name': 'jobs-s3', 'key': 'AWS_SECRET_ACCESS_KEY'}
        assert env['AWS_SESSION_TOKEN'] == {'name': 'jobs-s3', 'key': 'AWS_SESSION_TOKEN', 'optional': True}
        assert 'jobs-store' not in {v['name'] for v in pod['spec']['volumes']}
        assert '--job-store' not in container['command']


def test_an_object_store_on_the_service_accounts_identity_needs_nothing_more():
    bare = {**CPU, 'jobs': {'objectStore': {'bucket': 'video-jobs'}}}
    st = stage(bare)
    plan = reconcile(st, world(st, children=False))
    pods = [o for o in plan.create if o['kind'] == 'Pod']
    assert len(pods) == 2 and not any(e['name'].startswith('AWS_') for p in pods
                                      for c in p['spec']['containers'] for e in c.get('env', ()))
