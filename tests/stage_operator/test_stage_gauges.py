"""The operator's per-stage gauges, from the status a reconcile writes: replicas desired vs ready, conditions, the
rollout revision (an old revision's series goes), restarts, the autoscaler's metric; all gone when the stage is."""
from __future__ import annotations

from prometheus_client import REGISTRY

from stage_operator import stage_gauges

STATUS = {'replicas': 2, 'readyReplicas': 1, 'updatedReplicas': 2, 'restarts': {'total': 3},
          'conditions': [{'type': 'Ready', 'status': 'False'}, {'type': 'Degraded', 'status': 'True'}],
          'rollout': {'currentRevision': 'abc', 'stableRevision': 'old'},
          'autoscaling': {'desiredReplicas': 3, 'metric': 'cost', 'metricValue': 5e7}}


def value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, {'namespace': 'gauges', 'stage': 's', **labels})


def test_the_status_becomes_gauges_and_an_old_revision_leaves():
    stage_gauges.publish('gauges', 's', STATUS, spec_replicas=1)
    assert [value('diffstage_operator_stage_replicas', kind=k) for k in ('desired', 'current', 'ready', 'updated')] \
        == [3.0, 2.0, 1.0, 2.0]                                           # desired: the autoscaler's, not spec
    assert value('diffstage_operator_stage_condition', type='Ready') == 0.0
    assert value('diffstage_operator_stage_condition', type='Degraded') == 1.0
    assert value('diffstage_operator_stage_rollout_info', current_revision='abc', stable_revision='old') == 1.0
    assert value('diffstage_operator_stage_restarts') == 3.0
    assert value('diffstage_operator_stage_autoscaling_metric', metric='cost') == 5e7
    rolled = stage_gauges.merged(STATUS, {'rollout': {'stableRevision': 'abc'}, 'autoscaling': None})
    stage_gauges.publish('gauges', 's', rolled, spec_replicas=1)
    assert value('diffstage_operator_stage_rollout_info', current_revision='abc', stable_revision='old') is None
    assert value('diffstage_operator_stage_rollout_info', current_revision='abc', stable_revision='abc') == 1.0
    assert value('diffstage_operator_stage_replicas', kind='desired') == 1.0       # no autoscaler: spec.replicas
    assert value('diffstage_operator_stage_autoscaling_metric', metric='cost') is None
    stage_gauges.forget('gauges', 's')
    assert value('diffstage_operator_stage_replicas', kind='ready') is None
    assert value('diffstage_operator_stage_restarts') is None
