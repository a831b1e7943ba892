"""What kubectl reads from the API, checked over HTTP (so it is covered where kubectl is not installed):
`/version`, the OpenAPI v3 index and group-version documents, server-side Tables (lists, single objects,
watches) and the watch content type."""
from __future__ import annotations

import datetime
import json

import httpx
import pytest

from e2e.local import tables
from e2e.local.kube_emulator import running
from stage_operator.api.meta import API_VERSION, GROUP, KIND, PLURAL, VERSION

TABLE = 'application/json;as=Table;v=v1;g=meta.k8s.io,application/json;as=Table;v=v1beta1;g=meta.k8s.io,' \
        'application/json'
STAGES = f'/apis/{API_VERSION}/namespaces/default/{PLURAL}'


@pytest.fixture(scope='module')
def http():
    with running() as emulator, httpx.Client(base_url=emulator.base_url, timeout=10) as client:
        client.post(STAGES, json={'apiVersion': API_VERSION, 'kind': KIND, 'metadata': {'name': 's'},
                                  'spec': {'model': {'builtin': 'tiny-sd'}, 'replicas': 3}})
        client.patch(f'{STAGES}/s/status', headers={'Content-Type': 'application/merge-patch+json'}, json={
            'status': {'phase': 'Ready', 'reason': 'AllReplicasReady', 'readyReplicas': 3, 'conditions': [
                {'type': 'Ready', 'status': 'True', 'reason': 'AllReplicasReady', 'lastTransitionTime': 'x'}]}})
        yield client


def test_version_is_a_supported_kubernetes(http):
    version = http.get('/version').json()
    assert (version['major'], version['minor']) == ('1', '31') and version['gitVersion'].startswith('v1.31.')


def test_openapi_v3_index_and_the_crds_document(http):
    index = http.get('/openapi/v3').json()['paths']
    assert {'api/v1', f'apis/{GROUP}/{VERSION}'} <= set(index)
    document = http.get(index[f'apis/{GROUP}/{VERSION}']['serverRelativeURL']).json()
    schema = document['components']['schemas'][f'io.diffstage.{VERSION}.{KIND}']
    assert schema['x-kubernetes-group-version-kind'] == [{'group': GROUP, 'kind': KIND, 'version': VERSION}]
    assert schema['properties']['spec']['properties']['parallel']['properties']['cfgParallelSize']['maximum'] == 2
    assert schema['properties']['metadata']['allOf'] == [
        {'$ref': '#/components/schemas/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta'}]
    patch = document['paths'][f'/apis/{GROUP}/{VERSION}/namespaces/{{namespace}}/{PLURAL}/{{name}}']['patch']
    assert [p['name'] for p in patch['parameters']] == ['fieldValidation']
    pods = http.get(index['api/v1']['serverRelativeURL']).json()['components']['schemas']['io.k8s.api.core.v1.Pod']
    assert pods['x-kubernetes-preserve-unknown-fields'] is True
    assert http.get('/openapi/v3/apis/nope.io/v1').status_code == 404


def test_openapi_v2_is_json_only(http):
    assert http.get('/openapi/v2', headers={'Accept': 'application/com.github.proto-openapi.spec.v2@v1.0+protobuf'}
                    ).status_code == 406
    v2 = http.get('/openapi/v2', headers={'Accept': 'application/json'}).json()
    assert v2['swagger'] == '2.0' and f'io.diffstage.{VERSION}.{KIND}' in v2['definitions']


def test_a_list_as_a_table_has_the_crd_columns(http):
    response = http.get(STAGES, headers={'Accept': TABLE})
    assert response.headers['Content-Type'].startswith('application/json')
    table = response.json()
    assert (table['kind'], table['apiVersion']) == ('Table', 'meta.k8s.io/v1')
    names = [c['name'] for c in table['columnDefinitions']]
    assert names == ['Name', 'Phase', 'Reason', 'Ready', 'Sleeping', 'Replicas', 'GPUs', 'Ranks', 'Queued', 'Jobs',
                     'Restarts', 'Age']
    wide = [c['name'] for c in table['columnDefinitions'] if c['priority'] == 1]
    assert wide == ['Reason', 'Sleeping', 'Ranks', 'Queued', 'Jobs'], 'shown with -o wide'
    (row,) = table['rows']  # no topology in this status yet: GPUs unknown; Ranks from the spec's default; no sleep
    assert row['cells'][:9] == ['s', 'Ready', 'AllReplicasReady', 3, None, 3, None, 1, None]
    assert row['object']['kind'] == 'PartialObjectMetadata' and row['object']['metadata']['name'] == 's'
    full = http.get(f'{STAGES}/s', headers={'Accept': TABLE}, params={'includeObject': 'Object'}).json()
    assert full['rows'][0]['object']['spec']['replicas'] == 3
    assert http.get(f'{STAGES}/s').json()['kind'] == KIND, 'plain JSON without the Table Accept'


def test_a_watch_streams_json_and_tables(http):
    plain = http.get(STAGES, params={'watch': 'true', 'timeoutSeconds': '0.3'})
    assert plain.headers['Content-Type'] == 'application/json'
    events = [json.loads(line) for line in plain.text.splitlines() if line.strip()]
    assert [e['type'] for e in events] == ['ADDED'] and events[0]['object']['kind'] == KIND
    as_table = http.get(STAGES, params={'watch': 'true', 'timeoutSeconds': '0.3'}, headers={'Accept': TABLE})
    (event,) = [json.loads(line) for line in as_table.text.splitlines() if line.strip()]
    assert event['object']['kind'] == 'Table' and event['object']['rows'][0]['cells'][0] == 's'


def test_pod_columns_and_jsonpath_and_age():
    pod = {'metadata': {'name': 'p', 'creationTimestamp': '2026-01-01T00:00:00Z'},
           'spec': {'containers': [{'name': 'a'}, {'name': 'b'}]},
           'status': {'phase': 'Running', 'podIP': '127.1.0.2', 'containerStatuses': [
               {'name': 'a', 'ready': True, 'restartCount': 2, 'state': {'running': {}}},
               {'name': 'b', 'ready': False, 'restartCount': 1, 'state': {'waiting': {'reason': 'CrashLoopBackOff'}}}]}}
    row = tables.table(tables.POD_COLUMNS, [pod])['rows'][0]['cells']
    assert row[:4] == ['p', '1/2', 'CrashLoopBackOff', '3'] and row[5] == '127.1.0.2'
    obj = {'status': {'conditions': [{'type': 'A', 'reason': 'x'}, {'type': 'Ready', 'reason': 'y'}]}, 'l': [1, 2]}
    assert tables.jsonpath(obj, '.status.conditions[?(@.type=="Ready")].reason') == ['y']
    assert tables.jsonpath(obj, '{.l[1]}') == [2] and tables.jsonpath(obj, '.l[*]') == [1, 2]
    assert tables.jsonpath(obj, '.missing.x') == []
    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    ages = {s: tables.age((now - datetime.timedelta(seconds=s)).strftime('%Y-%m-%dT%H:%M:%SZ'), now)
            for s in (5, 150, 3600, 3 * 86400 + 3600, 400 * 86400)}
    assert ages == {5: '5s', 150: '2m30s', 3600: '60m', 3 * 86400 + 3600: '3d1h', 400 * 86400: '400d'}
