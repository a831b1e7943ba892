"""Admission as kube-apiserver does it, over HTTP. The expected bodies are written from the Kubernetes API
conventions (api-conventions.md "Response Status Kind"; apierrors.NewInvalid: 422, reason Invalid,
details {name, group, kind, causes[{reason, message, field}]}, message `<Kind>.<group> "<name>" is invalid:
<field>: <detail>` or `[...]` for several), never from the emulator's own output."""
from __future__ import annotations

import copy

import httpx
import pytest

from e2e.local import admission
from e2e.local.kube_emulator import running
from stage_operator.api.meta import API_VERSION, GROUP, KIND, PLURAL

STAGES = f'/apis/{API_VERSION}/namespaces/default/{PLURAL}'
MERGE = {'Content-Type': 'application/merge-patch+json'}
PRODUCT = ('parallel degrees multiply to 4 (tensor 1 x ulysses 2 x ring 1 x cfg 2 x data 1 x pipeline 1) but '
           'resources.gpusPerPod is 2')
BLOCKED = ('Invalid value: "null": some validation rules were not checked because the object was invalid; '
           'correct the existing errors to complete validation')


@pytest.fixture(scope='module')
def api():
    with running() as emulator:
        yield emulator
        crashes = list(emulator.errors)
    assert not crashes, crashes


@pytest.fixture
def http(api):
    with httpx.Client(base_url=api.base_url, timeout=10) as client:
        yield client


def stage(name: str, **spec) -> dict:
    return {'apiVersion': API_VERSION, 'kind': KIND, 'metadata': {'name': name},
            'spec': {'model': {'builtin': 'tiny-sd'}, **spec}}


def invalid(name: str, *causes: tuple[str, str, str]) -> dict:
    """The Status of apierrors.NewInvalid(GroupKind{GROUP, KIND}, name, errs), causes as (reason, field, detail)."""
    listed = [f'{field}: {detail}' for _, field, detail in causes]
    message = listed[0] if len(listed) == 1 else '[' + ', '.join(listed) + ']'
    return {'kind': 'Status', 'apiVersion': 'v1', 'metadata': {}, 'status': 'Failure',
            'message': f'{KIND}.{GROUP} "{name}" is invalid: {message}', 'reason': 'Invalid',
            'details': {'name': name, 'group': GROUP, 'kind': KIND,
                        'causes': [{'reason': r, 'message': d, 'field': f} for r, f, d in causes]},
            'code': 422}


CASES = {
    'cel-product': (dict(parallel={'cfgParallelSize': 2, 'ulyssesDegree': 2}, resources={'gpusPerPod': 2}),
                    [('FieldValueInvalid', 'spec', f'Invalid value: "object": {PRODUCT}')]),
    'schema-maximum': (dict(parallel={'cfgParallelSize': 3}, resources={'gpusPerPod': 3}),
                       [('FieldValueInvalid', 'spec.parallel.cfgParallelSize', 'Invalid value: 3: spec.parallel.'
                         'cfgParallelSize in body should be less than or equal to 2')]),
    'schema-minimum': (dict(replicas=-1),
                       [('FieldValueInvalid', 'spec.replicas',
                         'Invalid value: -1: spec.replicas in body should be greater than or equal to 0')]),
    'enum': (dict(engine={'executionMode': 'turbo'}),
             [('FieldValueNotSupported', 'spec.engine.executionMode',
               'Unsupported value: "turbo": supported values: "request", "step"'), ('FieldValueInvalid', '<nil>', BLOCKED)]),
    'type': (dict(replicas='two'),
             [('FieldValueTypeInvalid', 'spec.replicas',
               'Invalid value: "string": spec.replicas in body must be of type integer: "string"'),
              ('FieldValueInvalid', '<nil>', BLOCKED)]),
    'cel-and-maximum': (dict(parallel={'cfgParallelSize': 3, 'ulyssesDegree': 2}, resources={'gpusPerPod': 2}),
                        [('FieldValueInvalid', 'spec.parallel.cfgParallelSize', 'Invalid value: 3: spec.parallel.'
                          'cfgParallelSize in body should be less than or equal to 2'),
                         ('FieldValueInvalid', 'spec', 'Invalid value: "object": parallel degrees multiply to 6 '
                          '(tensor 1 x ulysses 2 x ring 1 x cfg 3 x data 1 x pipeline 1) but resources.gpusPerPod is 2')]),
}


@pytest.mark.parametrize('case', sorted(CASES))
def test_create_is_refused_with_the_api_servers_status(http, api, case):
    spec, causes = CASES[case]
    response = http.post(STAGES, json=stage(case, **spec))
    assert response.status_code == 422
    assert response.headers['Content-Type'].startswith('application/json')
    assert response.json() == invalid(case, *causes)
    assert api.get('dstage', case) is None, 'nothing stored, no watch event: the operator never sees it'


def test_a_required_field_missing(http):
    response = http.post(STAGES, json={'apiVersion': API_VERSION, 'kind': KIND, 'metadata': {'name': 'nospec'}})
    assert response.json() == invalid('nospec', ('FieldValueRequired', 'spec', 'Required value'))


def test_unknown_fields_are_pruned_or_refused_by_field_validation(http, api):
    body = stage('pruned', bogus=1, engine={'nope': True})
    strict = http.post(STAGES, params={'fieldValidation': 'Strict'}, json=body)
    assert strict.status_code == 400 and strict.json() == {
        'kind': 'Status', 'apiVersion': 'v1', 'metadata': {}, 'status': 'Failure', 'reason': 'BadRequest', 'code': 400,
        'message': f'{KIND} in version "v1alpha1" cannot be handled as a {KIND}: strict decoding error: '
                   'unknown field "spec.bogus", unknown field "spec.engine.nope"',
        'details': {'reason': 'BadRequest'}}
    warned = http.post(STAGES, params={'fieldValidation': 'Warn'}, json=body)
    assert warned.status_code == 201
    assert warned.headers['Warning'] == '299 - "unknown field \\"spec.bogus\\"", 299 - "unknown field \\"spec.engine.nope\\""'
    assert 'bogus' not in warned.json()['spec'] and 'nope' not in warned.json()['spec']['engine']
    http.delete(f'{STAGES}/pruned')


def test_a_warning_belongs_to_its_answer_only(http):
    """Regression: kmock merged a Warning header into its reaction, so every later answer carried it."""
    warned = http.post(STAGES, params={'fieldValidation': 'Warn'}, json=stage('warned-once', bogus=1))
    assert warned.status_code == 201 and 'unknown field \\"spec.bogus\\"' in warned.headers['Warning']
    for later in (http.get(f'{STAGES}/warned-once'), http.get(STAGES), http.get('/api/v1/namespaces/default/pods'),
                  http.post(STAGES, json=stage('clean'))):
        assert later.is_success and 'Warning' not in later.headers, (later.request.url, later.headers)
    http.delete(f'{STAGES}/warned-once')
    http.delete(f'{STAGES}/clean')


def test_defaults_come_from_the_schema(http):
    created = http.post(STAGES, json=stage('defaults')).json()
    assert created['spec']['parallel'] == {'tensorParallelSize': 1, 'ulyssesDegree': 1, 'ringDegree': 1,
                                           'cfgParallelSize': 1, 'dataParallelSize': 1, 'pipelineParallelSize': 1}
    assert created['spec']['replicas'] == 1 and created['spec']['engine']['executionMode'] == 'request'


def test_status_and_scale_writes_are_validated(http):
    http.post(STAGES, json=stage('writes'))
    bad_status = http.patch(f'{STAGES}/writes/status', headers=MERGE, json={'status': {'phase': 'Sleeping'}})
    assert bad_status.json() == invalid('writes', (
        'FieldValueNotSupported', 'status.phase', 'Unsupported value: "Sleeping": supported values: "Pending", '
        '"Progressing", "Ready", "Degraded", "Stalled", "Terminating"'), ('FieldValueInvalid', '<nil>', BLOCKED))
    bad_scale = http.patch(f'{STAGES}/writes/scale', headers=MERGE, json={'spec': {'replicas': -2}})
    assert bad_scale.json() == invalid('writes', ('FieldValueInvalid', 'spec.replicas', 'Invalid value: -2: '
                                                  'spec.replicas in body should be greater than or equal to 0'))
    assert http.patch(f'{STAGES}/writes/scale', headers=MERGE, json={'spec': {'replicas': 4}}).status_code == 200


WIDGETS = {
    'apiVersion': 'apiextensions.k8s.io/v1', 'kind': 'CustomResourceDefinition',
    'metadata': {'name': 'widgets.example.com'},
    'spec': {'group': 'example.com', 'scope': 'Namespaced',
             'names': {'kind': 'Widget', 'plural': 'widgets', 'singular': 'widget', 'listKind': 'WidgetList'},
             'versions': [{'name': 'v1', 'served': True, 'storage': True, 'schema': {'openAPIV3Schema': {
                 'type': 'object', 'properties': {'spec': {'type': 'object', 'properties': {
                     'size': {'type': 'integer'},
                     'owner': {'type': 'string', 'x-kubernetes-validations': [
                         {'rule': 'self == oldSelf', 'message': 'owner is immutable'}]}}}}}}}]}}


def test_a_posted_crd_is_served_with_transition_rules(http):
    assert http.post('/apis/apiextensions.k8s.io/v1/customresourcedefinitions', json=WIDGETS).status_code == 201
    url = '/apis/example.com/v1/namespaces/default/widgets'
    widget = {'apiVersion': 'example.com/v1', 'kind': 'Widget', 'metadata': {'name': 'w'},
              'spec': {'size': 1, 'owner': 'ann'}}
    assert http.post(url, json=widget).status_code == 201, 'oldSelf rules do not run on create'
    assert http.patch(f'{url}/w', headers=MERGE, json={'spec': {'size': 2}}).status_code == 200
    changed = http.patch(f'{url}/w', headers=MERGE, json={'spec': {'owner': 'bob'}})
    assert changed.status_code == 422 and changed.json()['details']['causes'] == [
        {'reason': 'FieldValueInvalid', 'field': 'spec.owner', 'message': 'Invalid value: "string": owner is immutable'}]
    assert changed.json()['message'] == 'Widget.example.com "w" is invalid: spec.owner: Invalid value: "string": ' \
                                        'owner is immutable'
    discovery = http.get('/apis/example.com/v1').json()
    assert [r['name'] for r in discovery['resources']] == ['widgets']


def test_invalid_values_already_stored_are_ratcheted():
    """A write that leaves an invalid value as it was is not refused for it (validation ratcheting)."""
    schema = {'type': 'object', 'properties': {'spec': {'type': 'object', 'properties': {
        'a': {'type': 'integer', 'maximum': 2}, 'b': {'type': 'integer'}}}}}
    old = {'spec': {'a': 5, 'b': 1}}
    new = copy.deepcopy(old)
    new['spec']['b'] = 2
    assert admission.validate(schema, new, old) == []
    new['spec']['a'] = 6
    assert [e.field for e in admission.validate(schema, new, old)] == ['spec.a']


def test_prune_keeps_what_the_schema_declares_or_preserves():
    schema = {'type': 'object', 'properties': {
        'spec': {'type': 'object', 'properties': {
            'labels': {'type': 'object', 'additionalProperties': {'type': 'string'}},
            'free': {'type': 'object', 'x-kubernetes-preserve-unknown-fields': True},
            'bare': {'type': 'object'}, 'n': {'type': 'integer', 'nullable': False},
            'open': {'type': 'object', 'additionalProperties': True},
            'maybe': {'type': 'integer', 'nullable': True}}}}}
    obj = {'apiVersion': 'v', 'kind': 'K', 'metadata': {'name': 'x', 'anything': 1},
           'spec': {'labels': {'a': 'b'}, 'free': {'x': {'y': 1}}, 'bare': {'gone': 1}, 'n': None, 'extra': 2,
                    'open': {'k': [1]}, 'maybe': None}}
    assert admission.prune(schema, obj) == ['spec.bare.gone', 'spec.extra']
    assert obj == {'apiVersion': 'v', 'kind': 'K', 'metadata': {'name': 'x', 'anything': 1},
                   'spec': {'labels': {'a': 'b'}, 'free': {'x': {'y': 1}}, 'bare': {}, 'open': {'k': [1]},
                            'maybe': None}}
    assert admission.validate(schema, obj) == [], 'a null where the schema is nullable is valid'
