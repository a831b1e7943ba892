"""merge_patch (the status write) and contains (drift of children) — small pure helpers, checked exhaustively."""
from __future__ import annotations

import copy

import pytest

from stage_operator.plan import Delete, Plan, contains, merge_patch


def apply(target, patch):  # RFC 7386, independently of the emulator's copy
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = apply(out.get(k), v)
    return out


@pytest.mark.parametrize('old, new', [
    ({}, {'a': 1}),
    ({'a': 1}, {}),
    ({'a': {'b': 1, 'c': 2}}, {'a': {'b': 1}}),
    ({'a': [1, 2]}, {'a': [2]}),
    ({'a': {'b': 1}}, {'a': 5}),
    ({'conditions': [{'type': 'Ready', 'status': 'False'}], 'phase': 'Progressing'},
     {'conditions': [{'type': 'Ready', 'status': 'True'}], 'phase': 'Ready', 'readyReplicas': 2}),
    ({'x': {'lastFailure': {'reason': 'r'}}}, {'x': {}}),
])
def test_merge_patch_turns_old_into_new(old, new):
    patch = merge_patch(old, new)
    assert apply(old, patch) == new


def test_merge_patch_of_equal_objects_is_empty():
    status = {'a': {'b': [1, {'c': 2}]}, 'd': 'e'}
    assert merge_patch(status, copy.deepcopy(status)) == {}


@pytest.mark.parametrize('observed, desired, expected', [
    ({'spec': {'a': 1, 'clusterIP': '10.0.0.1'}}, {'spec': {'a': 1}}, True),
    ({'spec': {'a': 2}}, {'spec': {'a': 1}}, False),
    ({'ports': [{'port': 80, 'protocol': 'TCP', 'nodePort': 0}]}, {'ports': [{'port': 80}]}, True),
    ({'ports': [{'port': 80}, {'port': 81}]}, {'ports': [{'port': 80}]}, False),
    ({'labels': None}, {'labels': {'a': 'b'}}, False),
    (None, {'a': 1}, False),
])
def test_contains(observed, desired, expected):
    assert contains(observed, desired) is expected


def test_plan_counts_its_writes_and_summarises_them():
    assert Plan().writes == 0 and Plan().summary() == 'nothing to do'
    plan = Plan(create=[{'kind': 'Pod', 'metadata': {'name': 'p'}}], delete=[Delete('Pod', 'q', 'ScaleDown')],
                status={'phase': 'Ready'})
    assert plan.writes == 3
    assert plan.summary() == 'create Pod/p; delete Pod/q (ScaleDown); status'
