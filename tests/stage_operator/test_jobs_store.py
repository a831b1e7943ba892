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
