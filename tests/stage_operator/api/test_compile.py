"""spec.compile (api/compile.py): its bounds and shapes are the runtime's CompileConfig's, the API server and the
operator's parse refuse the same values, and every field says what it does (kubectl explain). The CEL refusals and
their words are cases of test_validation.py (COMPILE_CASES)."""
from __future__ import annotations

import copy

import pytest
from pydantic import ValidationError
from support.crd_check import admit, apply_defaults, version_schema

from stage_operator import crdgen
from stage_operator.api.spec import StageSpec
from stage_runtime.config import CompileConfig, parse_shape
from stage_runtime.config import compile as runtime_compile

CRD = crdgen.build_crd()
SCHEMA = version_schema(CRD)['properties']['spec']['properties']['compile']
BASE = {'apiVersion': 'diffstage.io/v1alpha1', 'kind': 'DiffusionStage', 'metadata': {'name': 's'},
        'spec': {'model': {'builtin': 'tiny-sd'}}}


def stage(compile_spec) -> dict:
    obj = copy.deepcopy(BASE)
    obj['spec']['compile'] = compile_spec
    return obj


def test_the_bounds_are_the_runtimes():
    props = SCHEMA['properties']
    assert props['mode']['enum'] == ['none', 'auto', 'regional', 'full']
    assert props['shapes']['maxItems'] == runtime_compile.MAX_SHAPES
    assert props['shapes']['items']['pattern'] == runtime_compile.SHAPE_PATTERN.pattern
    graphs = CompileConfig.model_fields['max_graphs'].metadata
    assert (props['maxGraphs']['minimum'], props['maxGraphs']['maximum']) == (
        next(m.ge for m in graphs if hasattr(m, 'ge')), next(m.le for m in graphs if hasattr(m, 'le')))
    assert (props['timeoutSeconds']['minimum'], props['timeoutSeconds']['maximum']) == (1, 86400)
    defaults = apply_defaults(version_schema(CRD), stage({}))['spec']['compile']
    runtime = CompileConfig()
    assert defaults == {'mode': runtime.mode, 'maxGraphs': runtime.max_graphs, 'timeoutSeconds': runtime.timeout_s}


def test_a_stage_without_compile_has_none_and_its_wire_form_is_unchanged():
    spec = StageSpec.model_validate(BASE['spec'])
    assert spec.compile is None and 'compile' not in spec.wire()
    assert 'compile' not in apply_defaults(version_schema(CRD), copy.deepcopy(BASE))['spec'], 'no default object'


@pytest.mark.parametrize('shape', ['64x64', '1024x1024', '832x480x81', '99999x1x1', '64', '0x64', '64x0', '64x64x',
                                   '64X64', '064x64', ' 64x64', '64x64x0', '123456x64', '64x64x64x64', '-64x64'])
def test_a_shape_is_admitted_exactly_when_the_runtime_parses_it(shape):
    try:
        parse_shape(shape)
        runtime_ok = True
    except ValueError:
        runtime_ok = False
    assert (admit(CRD, stage({'mode': 'regional', 'shapes': [shape]})) == []) == runtime_ok
    try:
        StageSpec.model_validate(stage({'mode': 'regional', 'shapes': [shape]})['spec'])
        operator_ok = True
    except ValidationError:
        operator_ok = False
    assert operator_ok == runtime_ok


@pytest.mark.parametrize('compile_spec', [
    {'mode': 'max'}, {'maxGraphs': 0}, {'maxGraphs': 4097}, {'timeoutSeconds': 0}, {'timeoutSeconds': 86401},
    {'timeoutSeconds': 'long'}, {'shapes': [f'{n}x{n}' for n in range(1, runtime_compile.MAX_SHAPES + 2)]},
    {'cache': {'hostPath': 'relative/folder'}}, {'cache': {'pvc': {}}}, {'cache': {'pvc': {'claimName': ''}}},
    {'shapes': '64x64'},
], ids=['mode', 'graphs-0', 'graphs-4097', 'timeout-0', 'timeout-86401', 'timeout-text', 'too-many-shapes',
        'host-path-relative', 'claim-unnamed', 'claim-empty', 'shapes-not-a-list'])
def test_the_api_server_and_the_operator_refuse_out_of_range_values(compile_spec):
    assert admit(CRD, stage(compile_spec)), f'{compile_spec!r} must be refused by the schema'
    with pytest.raises(ValidationError):
        StageSpec.model_validate(stage(compile_spec)['spec'])


def test_an_unknown_field_is_an_error_naming_it_not_ignored():
    """The API server prunes it (kubectl's strict field validation refuses it); the operator's parse names it."""
    with pytest.raises(ValidationError, match='cacheDir'):
        StageSpec.model_validate(stage({'mode': 'auto', 'cacheDir': '/var/cache'})['spec'])


def test_the_runtime_section_is_what_the_spec_says():
    spec = StageSpec.model_validate(stage({'mode': 'regional', 'shapes': ['64x48', '32x32x17'], 'maxGraphs': 8,
                                           'timeoutSeconds': 120})['spec'])
    assert spec.compile.enabled
    assert spec.compile.runtime('/var/cache/diffstage-compile') == CompileConfig(
        mode='regional', cache_dir='/var/cache/diffstage-compile', shapes=('64x48', '32x32x17'), max_graphs=8,
        timeout_s=120.0)


def _described(node, path='compile'):
    assert node.get('description', '').strip(), f'{path} has no description'
    for name, sub in (node.get('properties') or {}).items():
        yield from _described(sub, f'{path}.{name}')
    if isinstance(node.get('items'), dict):
        yield from _described(node['items'], f'{path}[]')
    yield path


def test_every_compile_field_has_a_description():
    assert set(_described(SCHEMA)) >= {'compile.mode', 'compile.shapes', 'compile.shapes[]', 'compile.maxGraphs',
                                       'compile.timeoutSeconds', 'compile.cache', 'compile.cache.hostPath',
                                       'compile.cache.pvc', 'compile.cache.pvc.claimName'}
