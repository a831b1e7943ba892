"""Pod views: readiness, the template hash, Unschedulable, and a Failed pod's termination message."""
from __future__ import annotations

import pytest

from stage_operator.observed import Observed, pod_view


def pod(name='s-0', replica='0', status=None, **meta):
    return {'metadata': {'name': name, 'labels': {'diffstage.io/replica': replica,
                                                  'diffstage.io/template-hash': 'h1'}, **meta},
            'status': status or {}}


def terminated(message, exit_code=3, reason='Error'):
    return {'phase': 'Failed', 'containerStatuses': [{'name': 'stage', 'restartCount': 0, 'state': {
        'terminated': {'exitCode': exit_code, 'reason': reason, 'message': message, 'finishedAt': 'T'}}}]}


@pytest.mark.parametrize('message, reason, text', [
    ('WorkerDied: rank 1 (pid 4242) killed by signal 9', 'WorkerDied', 'rank 1 (pid 4242) killed by signal 9'),
    ('InvalidConfiguration: num_gpus=3 is not divisible by 2\n', 'InvalidConfiguration', 'num_gpus=3 is not divisible by 2'),
    ('Traceback (most recent call last):\n  File "x"', 'Error', 'Traceback (most recent call last):\n  File "x"'),
    ('', 'Error', ''),
])
def test_failure_from_the_termination_message(message, reason, text):
    failure = pod_view(pod(status=terminated(message))).failure
    assert (failure.reason, failure.message, failure.exit_code, failure.time) == (reason, text, 3, 'T')


def test_oom_killed_keeps_the_kubelet_reason():
    assert pod_view(pod(status=terminated('', 137, 'OOMKilled'))).failure.reason == 'OOMKilled'


@pytest.mark.parametrize('status, ready, unschedulable', [
    ({'phase': 'Running', 'conditions': [{'type': 'Ready', 'status': 'True'}]}, True, None),
    ({'phase': 'Running', 'conditions': [{'type': 'Ready', 'status': 'False'}]}, False, None),
    ({'phase': 'Pending', 'conditions': [{'type': 'PodScheduled', 'status': 'False', 'reason': 'Unschedulable',
                                          'message': '0/2 nodes'}]}, False, '0/2 nodes'),
    ({'phase': 'Pending', 'conditions': [{'type': 'PodScheduled', 'status': 'False', 'reason': 'SchedulingGated'}]},
     False, None),
    ({}, False, None),
])
def test_readiness_and_scheduling(status, ready, unschedulable):
    view = pod_view(pod(status=status))
    assert (view.ready, view.unschedulable, view.failure) == (ready, unschedulable, None)


def test_terminating_pods_are_not_available_and_foreign_pods_are_ignored():
    view = pod_view(pod(status={'phase': 'Running', 'conditions': [{'type': 'Ready', 'status': 'True'}]},
                        deletionTimestamp='T'))
    assert view.ready and view.terminating and not view.available
    assert pod_view({'metadata': {'name': 'x', 'labels': {}}}) is None
    assert pod_view(pod(replica='abc')) is None
    assert list(Observed(pods=[pod('s-1', '1'), pod('s-0', '0'), {'metadata': {'name': 'y'}}]).pod_views()) == [0, 1]
