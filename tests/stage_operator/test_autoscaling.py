"""Table-driven cases for operator autoscaling (pure): the stabilized decision and the drain-then-delete plan."""
from __future__ import annotations

from typing import Any

import pytest

from stage_operator.api.spec import StageSpec
from stage_operator.autoscale import Policy, decide, stabilized
from stage_operator.clock import format_time
from stage_operator.health import HealthBook, PodHealth, ProbeResult
from stage_operator.observed import Failure, PodView
from stage_operator.scaledown import UNFENCE, fence, plan

P = Policy(low=1, high=4, target=2, up_window=10, down_window=30)
NOW = 1000.0


def samples(*pairs: tuple[float, int]) -> list[tuple[float, int]]:
    """(seconds ago, in flight) → (time, in flight), oldest first."""
    return [(NOW - ago, v) for ago, v in pairs]


# (case, current, samples, desired)
DECISIONS = [
    ('no-samples', 2, [], 2),
    ('load-within-target', 1, samples((20, 2), (0, 2)), 1),
    ('up-needs-the-whole-window', 1, samples((5, 6), (0, 6)), 1),
    ('up-after-the-window', 1, samples((12, 6), (5, 6), (0, 6)), 3),
    ('up-to-the-smallest-in-the-window', 1, samples((12, 8), (5, 4), (0, 8)), 2),
    ('a-dip-in-the-window-holds', 1, samples((12, 6), (5, 1), (0, 6)), 1),
    ('clamped-to-max', 1, samples((12, 100), (0, 100)), 4),
    ('down-needs-the-whole-window', 3, samples((20, 0), (0, 0)), 3),
    ('down-after-the-window', 3, samples((40, 0), (10, 1), (0, 0)), 1),
    ('down-to-the-largest-in-the-window', 4, samples((40, 2), (10, 5), (0, 0)), 3),
    ('never-below-min', 2, samples((40, 0), (0, 0)), 1),
    ('window-start-sample-counts', 3, samples((31, 6), (0, 0)), 3),
]


@pytest.mark.parametrize('current, history, desired', [c[1:] for c in DECISIONS], ids=[c[0] for c in DECISIONS])
def test_stabilized_decision(current, history, desired):
    assert stabilized(current, history, NOW, P)[0] == desired


def spec(**autoscaling: Any) -> StageSpec:
    return StageSpec.model_validate({'model': {'builtin': 'tiny-sd'}, 'replicas': 2, 'autoscaling': {
        'mode': 'Operator', 'maxReplicas': 3, 'scaleUpStabilizationSeconds': 0, **autoscaling}})


def test_decide_records_the_decision_and_never_touches_spec():
    s = spec(targetInFlightPerReplica=2)
    desired, status, event = decide(s, None, [], NOW)
    assert desired == 2 and status['desiredReplicas'] == 2 and event is None and 'start at 2' in status['reason']
    desired, status, event = decide(s, status, samples((0, 5)), NOW)
    assert desired == 3 and status == {'desiredReplicas': 3, 'metric': 'inflight', 'metricValue': 5.0,
                                       'lastScaleTime': format_time(NOW),
                                       'reason': status['reason']} and 'scale up to 3' in status['reason']
    assert event[:2] == ('Normal', 'ScaledUp') and event[2].startswith('2 → 3')
    assert decide(s, status, samples((0, 5)), NOW + 1) == (3, None, None), 'unchanged: nothing to write'
    assert s.replicas == 2


def test_policy_defaults_target_to_the_engine_capacity():
    s = StageSpec.model_validate({'model': {'builtin': 'tiny-sd'}, 'engine': {'maxNumSeqs': 4},
                                  'autoscaling': {'mode': 'Operator', 'maxReplicas': 5}})
    p = Policy.of(s)
    assert (p.low, p.high, p.target, p.up_window, p.down_window) == (1, 5, 4, 0, 300)
    assert [p.recommend(n) for n in (0, 1, 4, 5, 100)] == [1, 1, 1, 2, 5]


def view(index: int, phase: str = 'Running', draining: float | None = None, failed: bool = False) -> PodView:
    return PodView(name=f's-{index}', index=index, phase='Failed' if failed else phase, ready=phase == 'Running',
                   template_hash='h', terminating=False, unschedulable=None, restarts=0, uid=f'u{index}',
                   failure=Failure('WorkerDied', '', 3, None) if failed else None,
                   serving=draining is None, draining_since=draining, pod_ip='127.100.0.9')


def load(n: int | None, at: float = NOW - 0.5) -> PodHealth:
    return PodHealth('Healthy', at, 0, True, '', 'ready', 0 if n is None else 0, n)


# (case, desired, pods, in flight per pod (None: not probed), probe time offset) -> (members, patched, deleted)
SCALEDOWN = [
    ('steady', 2, [view(0), view(1)], [1, 1], ([0, 1], [], [])),
    ('scale-up-takes-the-lowest-free-index', 3, [view(0), view(2)], [0, 0], ([0, 1, 2], [], [])),
    ('fence-the-least-loaded', 1, [view(0), view(1)], [0, 3], ([1], [('s-0', 'fence')], [])),
    ('a-tie-removes-the-highest-index', 1, [view(0), view(1)], [2, 2], ([0], [('s-1', 'fence')], [])),
    ('a-failed-pod-goes-first-at-once', 1, [view(0), view(1, failed=True)], [0, None], ([0], [], ['s-1'])),
    ('a-pending-pod-goes-at-once', 1, [view(0), view(1, 'Pending')], [5, None], ([0], [], ['s-1'])),
    ('draining-waits-while-busy', 1, [view(0), view(1, draining=NOW - 5)], [0, 1], ([0], [], [])),
    ('draining-deleted-once-idle', 1, [view(0), view(1, draining=NOW - 5)], [0, 0], ([0], [], ['s-1'])),
    ('idle-but-probed-before-the-fence', 1, [view(0), view(1, draining=NOW - 0.1)], [0, 0], ([0], [], [])),
    ('drain-timeout', 1, [view(0), view(1, draining=NOW - 61)], [0, 4], ([0], [], ['s-1'])),
    ('scale-back-up-returns-a-draining-pod', 2, [view(0), view(1, draining=NOW - 5)], [0, 1],
     ([0, 1], [('s-1', 'unfence')], [])),
]


@pytest.mark.parametrize('desired, pods, loads, expected', [c[1:] for c in SCALEDOWN], ids=[c[0] for c in SCALEDOWN])
def test_scale_down_plan(desired, pods, loads, expected):
    health = {p.uid: load(n) for p, n in zip(pods, loads, strict=True) if n is not None}
    out = plan(desired, {p.index: p for p in pods}, health, 60, NOW)
    members, patched, deleted = expected
    assert out.members == members
    kinds = {'fence': fence(NOW), 'unfence': UNFENCE}
    assert out.patch == [(name, kinds[kind]) for name, kind in patched]
    assert [name for name, _ in out.delete] == deleted
    assert sorted(out.kept) == sorted(set(members) & {p.index for p in pods})
    if pods[-1].draining_since and not deleted and not patched:  # still draining: look again by the timeout
        assert out.requeue_after is not None and 0 < out.requeue_after <= 60


def test_fence_takes_the_pod_out_of_the_service_and_marks_the_time():
    assert fence(NOW) == {'metadata': {'labels': {'diffstage.io/serving': 'false'},
                                       'annotations': {'diffstage.io/draining-since': format_time(NOW, millis=True),
                                                       'diffstage.io/drain-reason': 'ScaleDown'}}}


def test_health_book_counts_consecutive_failures_and_reports_changes():
    book = HealthBook()
    h, changed = book.record('u', ProbeResult(1.0, error='ConnectionRefused'))
    assert changed and h.health == 'Unreachable' and h.failures == 1 and not h.answered
    assert h.failed(1, ready=False) is None, 'a stage that never answered is still starting'
    h, changed = book.record('u', ProbeResult(2.0, state='ready', waiting=1, running=2))
    assert changed and h.health == 'Healthy' and h.in_flight == 3 and h.failures == 0
    assert book.record('u', ProbeResult(3.0, state='ready', waiting=1, running=2))[1] is False, 'nothing new'
    for at in (4.0, 5.0):
        h, _ = book.record('u', ProbeResult(at, error='TimeoutError'))
    assert h.failures == 2 and h.failed(3, ready=False) is None
    assert h.failed(2, ready=False).startswith('no answer to 2')
    h, _ = book.record('u', ProbeResult(6.0, dead='Engine is dead: worker rank 1 died'))
    assert h.health == 'Unhealthy' and h.failed(3, ready=True) == 'Engine is dead: worker rank 1 died'
    book.forget_except(set())
    assert book.snapshot() == {}


def test_demand_is_the_requests_in_flight_plus_the_video_jobs_queued_in_the_store_counted_once():
    """A backlog of video jobs waits in the shared store, in no replica's engine: it is load to scale on, once (each
    replica counts the same store; the newest count is the largest)."""
    from stage_operator.autoscale import demand

    def probed(running: int, queued: int | None) -> PodHealth:
        jobs = None if queued is None else {'here': running, 'queued': queued, 'in_progress': 2, 'completed': 9,
                                            'failed': 0}
        return PodHealth('Healthy', NOW, answered=True, waiting=0, running=running, jobs=jobs)

    assert demand([probed(1, 6), probed(1, 5)]) == 2 + 6
    assert demand([probed(2, None), probed(1, None)]) == 3                  # no job store: requests alone
    assert Policy(1, 8, 1, 0, 300).recommend(demand([probed(1, 6), probed(1, 6)])) == 8
