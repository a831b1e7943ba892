"""The Kubernetes API emulator over real HTTP: the official client, httpx, and kopf end to end."""
from __future__ import annotations

import datetime
import json
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import httpx
import kmock
import kubernetes
import pytest
from kubernetes.client.rest import ApiException
from support.kube_emulator import KubeEmulator
from support.waiting import wait_until

STAGES = ('diffstage.io', 'v1alpha1', 'default', 'diffusionstages')
MERGE = {'Content-Type': 'application/merge-patch+json'}
JSON_PATCH = {'Content-Type': 'application/json-patch+json'}


@pytest.fixture
def core(kube_emulator: KubeEmulator) -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api(kube_emulator.api_client())


@pytest.fixture
def custom(kube_emulator: KubeEmulator) -> kubernetes.client.CustomObjectsApi:
    return kubernetes.client.CustomObjectsApi(kube_emulator.api_client())


@pytest.fixture
def http(kube_emulator: KubeEmulator) -> httpx.Client:
    with httpx.Client(base_url=kube_emulator.base_url, timeout=10) as client:
        yield client


def stage(name: str, replicas: int = 1, **metadata: Any) -> dict[str, Any]:
    return {'apiVersion': 'diffstage.io/v1alpha1', 'kind': 'DiffusionStage',
            'metadata': {'name': name, **metadata}, 'spec': {'model': {'builtin': 'tiny-sd'}, 'replicas': replicas}}


def configmap(name: str, labels: dict[str, str] | None = None, **metadata: Any) -> dict[str, Any]:
    return {'metadata': {'name': name, 'labels': labels or {}, **metadata}, 'data': {'k': 'v'}}


def watch(http: httpx.Client, path: str, **params: Any) -> list[tuple[str, str]]:
    """Events of a short server-side-limited watch, as (type, name)."""
    response = http.get(path, params={'watch': 'true', 'timeoutSeconds': '0.3', **params})
    assert response.status_code == 200, response.text
    events = [json.loads(line) for line in response.text.splitlines() if line.strip()]
    return [(e['type'], e['object']['metadata']['name']) for e in events]


def wait_for(condition: Callable[[], Any], timeout: float = 15) -> Any:
    return wait_until(condition, timeout, poll=0.05)


def api_status(call: Callable[[], Any]) -> int:
    with pytest.raises(ApiException) as info:
        call()
    return info.value.status


# 1. server-assigned fields; generation moves only with the spec
def test_server_assigned_fields_and_generation(custom):
    created = custom.create_namespaced_custom_object(*STAGES, stage('a'))
    meta = created['metadata']
    assert meta['uid'] and meta['generation'] == 1 and meta['namespace'] == 'default'
    assert datetime.datetime.strptime(meta['creationTimestamp'], '%Y-%m-%dT%H:%M:%SZ')
    rv = int(meta['resourceVersion'])

    spec_changed = custom.patch_namespaced_custom_object(*STAGES, 'a', {'spec': {'replicas': 3}})
    assert spec_changed['metadata']['generation'] == 2 and int(spec_changed['metadata']['resourceVersion']) > rv
    labelled = custom.patch_namespaced_custom_object(*STAGES, 'a', {'metadata': {'labels': {'x': 'y'}}})
    assert labelled['metadata']['generation'] == 2
    status = custom.patch_namespaced_custom_object_status(*STAGES, 'a', {'status': {'phase': 'Ready'}})
    assert status['metadata']['generation'] == 2 and status['status'] == {'phase': 'Ready'}
    versions = [int(o['metadata']['resourceVersion']) for o in (spec_changed, labelled, status)]
    assert versions == sorted(set(versions)), 'resourceVersion is a global increasing counter'
    assert status['metadata']['uid'] == meta['uid'] and status['metadata']['creationTimestamp'] == meta['creationTimestamp']


# 2. create answers 201 with the object
def test_create_answers_201_with_the_object(http, custom):
    response = http.post('/api/v1/namespaces/default/configmaps', json=configmap('cm'))
    assert response.status_code == 201 and response.json()['metadata']['name'] == 'cm'
    assert custom.create_namespaced_custom_object(*STAGES, stage('s'))['kind'] == 'DiffusionStage'


# 3. label and field selectors on list
@pytest.mark.parametrize('selector, names', [
    ('app=web', {'web1', 'web2'}),
    ('app==web,tier=front', {'web1'}),
    ('app!=web', {'db', 'bare'}),
    ('tier', {'web1', 'db'}),
    ('!tier', {'web2', 'bare'}),
    ('app in (db, cache)', {'db'}),
    ('app notin (web),tier', {'db'}),
    ('app in (web,db),tier notin (back)', {'web1', 'web2'}),  # notin matches a missing key
])
def test_label_selectors_on_list(core, selector, names):
    for name, labels in [('web1', {'app': 'web', 'tier': 'front'}), ('web2', {'app': 'web'}),
                         ('db', {'app': 'db', 'tier': 'back'}), ('bare', {})]:
        core.create_namespaced_config_map('default', configmap(name, labels))
    listed = core.list_namespaced_config_map('default', label_selector=selector)
    assert {item.metadata.name for item in listed.items} == names


def test_field_selectors_on_list(core):
    core.create_namespace({'metadata': {'name': 'other'}})
    core.create_namespaced_config_map('default', configmap('one'))
    core.create_namespaced_config_map('other', configmap('one'))
    core.create_namespaced_config_map('other', configmap('two'))
    by_name = core.list_config_map_for_all_namespaces(field_selector='metadata.name=one')
    assert sorted(i.metadata.namespace for i in by_name.items) == ['default', 'other']
    by_namespace = core.list_config_map_for_all_namespaces(field_selector='metadata.namespace=other,metadata.name!=one')
    assert [i.metadata.name for i in by_namespace.items] == ['two']


# 3-4. selectors on watch; watch from a resourceVersion; ADDED / MODIFIED / DELETED
def test_watch_honours_selectors_and_resource_version(core, http):
    core.create_namespaced_config_map('default', configmap('early', {'app': 'web'}))
    rv = core.list_namespaced_config_map('default').metadata.resource_version
    core.create_namespaced_config_map('default', configmap('web', {'app': 'web'}))
    core.create_namespaced_config_map('default', configmap('db', {'app': 'db'}))
    core.patch_namespaced_config_map('db', 'default', {'metadata': {'labels': {'app': 'web'}}})  # enters
    core.patch_namespaced_config_map('web', 'default', {'data': {'k': 'changed'}})
    core.patch_namespaced_config_map('early', 'default', {'metadata': {'labels': {'app': 'gone'}}})  # leaves
    core.delete_namespaced_config_map('web', 'default')

    path = '/api/v1/namespaces/default/configmaps'
    assert watch(http, path, resourceVersion=rv, labelSelector='app=web') == [
        ('ADDED', 'web'), ('ADDED', 'db'), ('MODIFIED', 'web'), ('DELETED', 'early'), ('DELETED', 'web')]
    assert watch(http, path, resourceVersion=rv, fieldSelector='metadata.name=db') == [
        ('ADDED', 'db'), ('MODIFIED', 'db')]
    assert watch(http, path) == [('ADDED', 'early'), ('ADDED', 'db')]  # no resourceVersion: the current state
    assert watch(http, path, labelSelector='app=gone') == [('ADDED', 'early')]


def test_watch_with_the_official_client_sees_later_changes(core):
    rv = core.list_namespaced_config_map('default').metadata.resource_version
    core.create_namespaced_config_map('default', configmap('x', {'app': 'web'}))
    core.create_namespaced_config_map('default', configmap('y', {'app': 'db'}))
    stream = kubernetes.watch.Watch().stream(core.list_namespaced_config_map, 'default', label_selector='app=web',
                                             resource_version=rv, timeout_seconds=1)
    assert [(e['type'], e['object'].metadata.name) for e in stream] == [('ADDED', 'x')]


# 5. status subresource isolation, both ways, for a CR and for pods
def test_status_subresource_isolation(custom, core, http):
    custom.create_namespaced_custom_object(*STAGES, {**stage('s'), 'status': {'phase': 'Fake'}})
    assert 'status' not in custom.get_namespaced_custom_object(*STAGES, 's')
    custom.patch_namespaced_custom_object_status(*STAGES, 's', {'status': {'phase': 'Ready'}, 'spec': {'replicas': 9}})
    custom.patch_namespaced_custom_object(*STAGES, 's', {'status': {'phase': 'Hacked'}, 'spec': {'replicas': 2}})
    obj = custom.get_namespaced_custom_object(*STAGES, 's')
    assert obj['status'] == {'phase': 'Ready'} and obj['spec']['replicas'] == 2

    replaced = {**obj, 'spec': {**obj['spec'], 'replicas': 4}, 'status': {'phase': 'Nope'}}
    obj = custom.replace_namespaced_custom_object(*STAGES, 's', replaced)
    assert obj['status'] == {'phase': 'Ready'} and obj['spec']['replicas'] == 4
    obj = custom.replace_namespaced_custom_object_status(*STAGES, 's', {**obj, 'spec': {}, 'status': {'phase': 'Degraded'}})
    assert obj['status'] == {'phase': 'Degraded'} and obj['spec']['replicas'] == 4

    core.create_namespaced_pod('default', {'metadata': {'name': 'p'}, 'spec': {'containers': [{'name': 'c', 'image': 'i'}]}})
    assert core.read_namespaced_pod('p', 'default').status.phase == 'Pending'
    http.patch('/api/v1/namespaces/default/pods/p/status', headers=MERGE, json={'status': {'phase': 'Running'}})
    http.patch('/api/v1/namespaces/default/pods/p', headers=MERGE, json={'status': {'phase': 'Failed'}})
    assert core.read_namespaced_pod('p', 'default').status.phase == 'Running'


# 6. PUT replaces; 409 on a stale resourceVersion and on an existing name
def test_put_and_conflicts(core):
    created = core.create_namespaced_config_map('default', configmap('cm'))
    created.data = {'new': 'data'}
    replaced = core.replace_namespaced_config_map('cm', 'default', created)
    assert replaced.data == {'new': 'data'}
    assert int(replaced.metadata.resource_version) > int(created.metadata.resource_version)
    assert api_status(lambda: core.replace_namespaced_config_map('cm', 'default', created)) == 409  # stale
    assert api_status(lambda: core.create_namespaced_config_map('default', configmap('cm'))) == 409
    stale_patch = {'metadata': {'resourceVersion': created.metadata.resource_version}, 'data': {}}
    assert api_status(lambda: core.patch_namespaced_config_map('cm', 'default', stale_patch)) == 409


# 7. json-patch (a failing `test` op is 422) and merge-patch
def test_json_patch_and_merge_patch(http):
    http.post('/api/v1/namespaces/default/configmaps', json=configmap('cm', {'a': '1', 'b': '2'}))
    url = '/api/v1/namespaces/default/configmaps/cm'
    rv = http.get(url).json()['metadata']['resourceVersion']
    failing = [{'op': 'test', 'path': '/metadata/resourceVersion', 'value': '999999'},
               {'op': 'replace', 'path': '/data/k', 'value': 'lost'}]
    response = http.patch(url, headers=JSON_PATCH, json=failing)
    assert response.status_code == 422 and response.json()['reason'] == 'Invalid'
    ops = [{'op': 'test', 'path': '/metadata/resourceVersion', 'value': rv},
           {'op': 'replace', 'path': '/data/k', 'value': 'kept'},
           {'op': 'add', 'path': '/metadata/finalizers', 'value': ['x/y']},
           {'op': 'add', 'path': '/metadata/finalizers/-', 'value': 'z/w'},
           {'op': 'remove', 'path': '/metadata/labels/a'}]
    patched = http.patch(url, headers=JSON_PATCH, json=ops).json()
    assert patched['data'] == {'k': 'kept'} and patched['metadata']['finalizers'] == ['x/y', 'z/w']
    merged = http.patch(url, headers=MERGE, json={'metadata': {'labels': {'b': None, 'c': '3'}}, 'data': {'n': 'm'}}).json()
    assert merged['metadata']['labels'] == {'c': '3'} and merged['data'] == {'k': 'kept', 'n': 'm'}
    smp = http.patch(url, headers={'Content-Type': 'application/strategic-merge-patch+json'}, json={'data': {'s': 't'}})
    assert smp.json()['data']['s'] == 't'


# 8. namespaces
def test_namespaces_list_default_and_create(core):
    assert [ns.metadata.name for ns in core.list_namespace().items] == ['default']
    assert core.read_namespace('default').status.phase == 'Active'
    core.create_namespace({'metadata': {'name': 'team'}})
    core.create_namespaced_config_map('team', configmap('cm'))
    assert {ns.metadata.name for ns in core.list_namespace().items} == {'default', 'team'}
    assert api_status(lambda: core.create_namespaced_config_map('missing', configmap('cm'))) == 404
    core.delete_namespace('team')  # takes its content with it
    assert api_status(lambda: core.read_namespaced_config_map('cm', 'team')) == 404


# 9. generateName
def test_generate_name(core):
    names = {core.create_namespaced_config_map('default', {'metadata': {'generateName': 'job-'}}).metadata.name
             for _ in range(5)}
    assert len(names) == 5 and all(n.startswith('job-') and len(n) == len('job-') + 5 for n in names)


# 10. the namespace comes from the URL, and watches see such objects
def test_namespace_from_the_url_is_visible_to_watches(http, kube_emulator):
    http.post('/api/v1/namespaces/default/configmaps', json={'metadata': {'name': 'cm'}})
    assert kube_emulator.get('configmaps', 'cm')['metadata']['namespace'] == 'default'
    assert watch(http, '/api/v1/namespaces/default/configmaps') == [('ADDED', 'cm')]


# 11. ownerReference garbage collection
def owner_ref(obj: dict[str, Any]) -> dict[str, Any]:
    return {'apiVersion': obj['apiVersion'], 'kind': obj['kind'], 'name': obj['metadata']['name'],
            'uid': obj['metadata']['uid'], 'controller': True}


def test_garbage_collection_cascades(custom, core, http):
    owner = custom.create_namespaced_custom_object(*STAGES, stage('owner'))
    other = custom.create_namespaced_custom_object(*STAGES, stage('other'))
    child = http.post('/api/v1/namespaces/default/configmaps',
                      json=configmap('child', ownerReferences=[owner_ref(owner)])).json()
    http.post('/api/v1/namespaces/default/pods', json={'metadata': {'name': 'grandchild', 'ownerReferences': [owner_ref(child)]}})
    http.post('/api/v1/namespaces/default/configmaps',
              json=configmap('shared', ownerReferences=[owner_ref(owner), owner_ref(other)]))
    http.post('/api/v1/namespaces/default/configmaps', json=configmap('unrelated'))

    custom.delete_namespaced_custom_object(*STAGES, 'owner')
    assert {cm.metadata.name for cm in core.list_namespaced_config_map('default').items} == {'shared', 'unrelated'}
    assert core.list_namespaced_pod('default').items == []
    custom.delete_namespaced_custom_object(*STAGES, 'other')  # the last live owner of `shared`
    assert {cm.metadata.name for cm in core.list_namespaced_config_map('default').items} == {'unrelated'}


def test_orphan_propagation_keeps_dependents(custom, core):
    owner = custom.create_namespaced_custom_object(*STAGES, stage('owner'))
    core.create_namespaced_config_map('default', configmap('child', ownerReferences=[owner_ref(owner)]))
    custom.delete_namespaced_custom_object(*STAGES, 'owner', propagation_policy='Orphan')
    assert core.read_namespaced_config_map('child', 'default').metadata.name == 'child'


# 12. finalizers
def test_finalizers_hold_deletion_until_released(custom, core, http):
    created = custom.create_namespaced_custom_object(*STAGES, stage('s', finalizers=['diffstage.io/cleanup']))
    owner = created
    core.create_namespaced_config_map('default', configmap('child', ownerReferences=[owner_ref(owner)]))
    rv = created['metadata']['resourceVersion']

    deleting = custom.delete_namespaced_custom_object(*STAGES, 's')
    assert deleting['metadata']['deletionTimestamp'] and int(deleting['metadata']['resourceVersion']) > int(rv)
    again = custom.delete_namespaced_custom_object(*STAGES, 's')
    assert again['metadata']['resourceVersion'] == deleting['metadata']['resourceVersion']
    assert custom.get_namespaced_custom_object(*STAGES, 's')['metadata']['deletionTimestamp']
    assert core.read_namespaced_config_map('child', 'default')  # GC waits for the owner to go
    adding = {'metadata': {'finalizers': ['diffstage.io/cleanup', 'more']}}
    assert api_status(lambda: custom.patch_namespaced_custom_object(*STAGES, 's', adding)) == 422

    custom.patch_namespaced_custom_object(*STAGES, 's', {'metadata': {'finalizers': None}})
    assert api_status(lambda: custom.get_namespaced_custom_object(*STAGES, 's')) == 404
    assert api_status(lambda: core.read_namespaced_config_map('child', 'default')) == 404
    assert watch(http, '/apis/diffstage.io/v1alpha1/namespaces/default/diffusionstages', resourceVersion=rv) == [
        ('MODIFIED', 's'), ('DELETED', 's')]


# 13. scale subresource
def test_scale_subresource(custom):
    custom.create_namespaced_custom_object(*STAGES, stage('s', replicas=2))
    custom.patch_namespaced_custom_object_status(*STAGES, 's', {'status': {'replicas': 2, 'selector': 'a=b'}})
    scale = custom.get_namespaced_custom_object_scale(*STAGES, 's')
    assert scale['spec'] == {'replicas': 2} and scale['status'] == {'replicas': 2, 'selector': 'a=b'}
    scaled = custom.patch_namespaced_custom_object_scale(*STAGES, 's', {'spec': {'replicas': 5}})
    assert scaled['spec'] == {'replicas': 5}
    obj = custom.get_namespaced_custom_object(*STAGES, 's')
    assert obj['spec']['replicas'] == 5 and obj['metadata']['generation'] == 2 and obj['status']['replicas'] == 2


# 14 & 16. built-in kinds and discovery
def test_discovery_lists_builtins_and_the_crd(kube_emulator, http):
    core_v1 = {r['name']: r for r in http.get('/api/v1').json()['resources']}
    assert {'pods', 'pods/status', 'services', 'configmaps', 'events', 'namespaces', 'nodes'} <= set(core_v1)
    assert core_v1['nodes']['namespaced'] is False and core_v1['pods']['namespaced'] is True
    groups = {g['name'] for g in http.get('/apis').json()['groups']}
    assert {'diffstage.io', 'kopf.dev', 'coordination.k8s.io'} <= groups
    stages = {r['name']: r for r in http.get('/apis/diffstage.io/v1alpha1').json()['resources']}
    assert set(stages) == {'diffusionstages', 'diffusionstages/status', 'diffusionstages/scale'}
    assert stages['diffusionstages']['kind'] == 'DiffusionStage' and stages['diffusionstages']['shortNames'] == ['dstage']
    assert {'watch', 'list', 'patch'} <= set(stages['diffusionstages']['verbs'])

    kube_emulator.declare('example.com/v1/widgets', 'Widget', subresources=('status',))
    assert http.post('/apis/example.com/v1/namespaces/default/widgets', json={'metadata': {'name': 'w'}}).status_code == 201
    assert http.get('/apis/nope.io/v1/namespaces/default/things').status_code == 404


# 15. mutating-call counter
def test_mutating_calls_are_counted(kube_emulator, core, custom):
    core.create_namespaced_config_map('default', configmap('cm'))
    custom.create_namespaced_custom_object(*STAGES, stage('s'))
    kube_emulator.reset_counts()
    core.list_namespaced_config_map('default')
    core.read_namespaced_config_map('cm', 'default')
    custom.get_namespaced_custom_object(*STAGES, 's')
    assert kube_emulator.mutation_count == 0, 'reads are not counted'

    before = kube_emulator.get('configmaps', 'cm')['metadata']['resourceVersion']
    core.patch_namespaced_config_map('cm', 'default', {'data': {'k': 'v'}})  # a no-op, but still a call
    assert kube_emulator.get('configmaps', 'cm')['metadata']['resourceVersion'] == before
    custom.patch_namespaced_custom_object_status(*STAGES, 's', {'status': {'phase': 'Ready'}})
    custom.delete_namespaced_custom_object(*STAGES, 's')
    core.delete_collection_namespaced_config_map('default')
    api_status(lambda: core.create_namespaced_config_map('default', {'metadata': {}}))  # failed calls count too
    assert kube_emulator.mutation_count == 5
    assert kube_emulator.counts == {('patch', 'configmaps', None): 1, ('patch', 'diffusionstages', 'status'): 1,
                                    ('delete', 'diffusionstages', None): 1,
                                    ('deletecollection', 'configmaps', None): 1, ('create', 'configmaps', None): 1}
    assert kube_emulator.mutations[0] == ('patch', 'configmaps', 'default', 'cm', None)
    kube_emulator.reset_counts()
    assert kube_emulator.mutation_count == 0 and not kube_emulator.counts


# helpers and kmock's DSL still work
def test_seed_objects_get_and_fault_injection(kube_emulator, core):
    node = {'metadata': {'name': 'gpu-1', 'namespace': 'ignored'},
            'status': {'allocatable': {'nvidia.com/gpu': '8'}}}
    kube_emulator.seed('nodes', node)
    assert core.read_node('gpu-1').status.allocatable == {'nvidia.com/gpu': '8'}
    assert [n['metadata']['name'] for n in kube_emulator.objects('v1/nodes')] == ['gpu-1']
    assert kube_emulator.get('nodes', 'gpu-1', namespace=None)['metadata'].get('namespace') is None
    assert kube_emulator.get('configmaps', 'absent') is None

    kube_emulator['post', kmock.resource('v1/configmaps')][:1] << 503
    assert api_status(lambda: core.create_namespaced_config_map('default', configmap('cm'))) == 503
    assert core.create_namespaced_config_map('default', configmap('cm')).metadata.name == 'cm'


# kopf end to end: create -> child ConfigMap + status; delete -> the child is garbage-collected
OPERATOR = textwrap.dedent('''
    import kopf
    import kubernetes

    @kopf.on.startup()
    def configure(settings, **_):
        settings.watching.server_timeout = 10

    @kopf.on.create('diffstage.io', 'v1alpha1', 'diffusionstages')
    def create_fn(spec, name, namespace, body, patch, **_):
        child = {'apiVersion': 'v1', 'kind': 'ConfigMap', 'metadata': {'name': f'{name}-config'},
                 'data': {'model': spec['model']['builtin']}}
        kopf.adopt(child, owner=body)
        kubernetes.client.CoreV1Api().create_namespaced_config_map(namespace, child)
        patch.status['phase'] = 'Progressing'
        patch.status['configMap'] = child['metadata']['name']  # not in the CRD's schema: pruned by the server
''')


def test_kopf_operator_end_to_end(kube_emulator, kubeconfig, custom, tmp_path, monkeypatch):
    from kopf.testing import KopfRunner

    # kopf imports the file as a module named after it and puts its folder on sys.path: a name that is not a
    # stdlib module's (an "operator.py" shadowed `operator` for every later subprocess given this sys.path),
    # and sys.path restored afterwards.
    monkeypatch.setattr(sys, 'path', [*sys.path])
    path = tmp_path / 'emulator_smoke_operator.py'
    path.write_text(OPERATOR)
    with KopfRunner(['run', '--namespace=default', '--standalone', str(path)], timeout=30) as runner:
        wait_for(lambda: kube_emulator.watching('diffusionstages'))  # the object arrives as a watch event
        custom.create_namespaced_custom_object(*STAGES, stage('tiny'))
        child = wait_for(lambda: kube_emulator.get('configmaps', 'tiny-config'))
        assert child['data'] == {'model': 'tiny-sd'}
        assert child['metadata']['ownerReferences'][0]['name'] == 'tiny'
        status = wait_for(lambda: (kube_emulator.get('dstage', 'tiny') or {}).get('status', {}).get('phase'))
        assert status == 'Progressing'
        assert 'configMap' not in kube_emulator.get('dstage', 'tiny')['status'], 'undeclared fields are pruned'
        custom.delete_namespaced_custom_object(*STAGES, 'tiny')
        wait_for(lambda: kube_emulator.get('dstage', 'tiny') is None)
        assert kube_emulator.get('configmaps', 'tiny-config') is None
    assert runner.exception is None, runner.output
    assert runner.exit_code == 0, runner.output
