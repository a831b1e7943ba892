"""spec.loras live on the replicas: which calls one replica needs (pure), when a look is needed at all, which
list counts as applied, and what reconcile writes of a sync (status.loraSync, Events, the ConfigMap)."""

from __future__ import annotations

from stage_operator import lora_sync
from stage_operator.lora_sync import LoraSync, needs_sync, plan_calls

INK = {"name": "ink", "path": "loras/ink", "pinned": True}
PIXEL = {"name": "pixel", "path": "loras/pixel", "pinned": True}


def listed(*entries, user=()):
    return [{"name": e["name"], "path": e["path"], "pinned": e["pinned"]} for e in entries] + list(user)


def test_a_replica_already_holding_the_list_needs_no_call():
    assert plan_calls(listed(INK), [INK], [INK]) == []


def test_an_added_entry_is_loaded_and_a_dropped_one_unloaded_first():
    assert plan_calls(listed(INK), [PIXEL], [INK]) == [("unload", "ink", None), ("load", "pixel", PIXEL)]


def test_another_file_under_the_same_name_is_unloaded_then_loaded():
    moved = {**INK, "path": "/adapters/ink-v2"}
    assert plan_calls(listed(INK), [moved], [INK]) == [("unload", "ink", None), ("load", "ink", moved)]


def test_an_adapter_a_user_loaded_at_run_time_is_never_touched():
    user = [{"name": "mine", "path": "/tmp/mine", "pinned": False}]
    assert plan_calls(listed(INK, user=user), [], [INK]) == [("unload", "ink", None)]


def test_a_look_is_needed_only_when_the_spec_moved_or_a_replica_lacks_a_wanted_name():
    assert not needs_sync([INK], [INK], {"s-0": ("ink",), "s-1": ("ink", "mine"), "s-2": None})
    assert needs_sync([INK, PIXEL], [INK], {"s-0": ("ink",)})             # the spec moved
    assert needs_sync([INK], [INK], {"s-0": ("ink",), "s-1": ()})          # a replica missing one (restarted)


def test_the_applied_list_defaults_to_the_spec_for_a_stage_without_a_record():
    class Lora:
        name, path, pinned = "ink", "loras/ink", True

    assert lora_sync.applied({}, [Lora()]) == (INK,)
    assert lora_sync.applied({"loraSync": {"applied": [PIXEL], "errors": []}}, [Lora()]) == (PIXEL,)
    assert lora_sync.applied({"loraSync": {"applied": []}}, [Lora()]) == ()


def test_a_sync_that_failed_somewhere_keeps_the_list_applied_before():
    failed = LoraSync(applied=(INK,), errors=("s-1: load pixel: not a file",), calls=("s-0: loaded pixel",))
    assert failed.wire() == {"applied": [INK], "errors": ["s-1: load pixel: not a file"]}


def test_reconcile_records_a_sync_moves_the_configmap_and_explains_it_without_touching_the_pods():
    import dataclasses

    from support.reconcile_world import CPU, pod, settle, stage, world

    from stage_operator.reconcile import reconcile

    spec = {**CPU, 'loras': [INK]}
    st, _ = settle(stage(spec), world(stage(spec)))
    assert st.status['loraSync'] == {'applied': [INK], 'errors': []}          # a new stage: its spec's list
    changed = stage({**CPU, 'loras': [PIXEL]}, status=st.status, generation=2)
    pods = [pod(changed, i) for i in range(2)]
    assert reconcile(changed, world(st, pods)).delete == []                    # no roll for a new list
    synced = LoraSync(applied=(PIXEL,), calls=('s-0: unloaded ink', 's-0: loaded pixel'))
    plan = reconcile(changed, dataclasses.replace(world(st, pods), lora_sync=synced))
    assert plan.status['loraSync'] == {'applied': [PIXEL]}
    [configmap] = [p for p in plan.patch if p.kind == 'ConfigMap']
    assert 'loras/pixel' in configmap.body['data']['stage.yaml'] and 'loras/ink' not in configmap.body['data'][
        'stage.yaml']
    assert [(e['reason'], e['message']) for e in plan.events if e['reason'].startswith('Lora')] == [
        ('LorasSynced', 's-0: unloaded ink; s-0: loaded pixel')]
    refused = LoraSync(applied=(INK,), errors=('s-1: load pixel: not a file',))
    plan = reconcile(changed, dataclasses.replace(world(st, pods), lora_sync=refused))
    assert plan.status['loraSync'] == {'errors': ['s-1: load pixel: not a file']}
    assert [e['reason'] for e in plan.events if e['type'] == 'Warning'] == ['LoraSyncFailed']
    assert not [p for p in plan.patch if p.kind == 'ConfigMap']               # starting replicas keep ink
