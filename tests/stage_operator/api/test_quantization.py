"""spec.quantization (api/quantization.py): its methods are the runtime's QuantizationMethod, the API server (the CRD's
schema and CEL, run by the same admission code as the emulated API server) and the operator's parse refuse the same
values with words naming the field and the value, the section it writes loads into the runtime's StageConfig, and a
stage without it gets the stage config it had. The CEL refusals are also cases of test_validation.py
(QUANTIZATION_CASES: each rule exercised, the operator's words the same)."""
from __future__ import annotations

import copy
import re
from typing import get_args

import pytest
import yaml
from pydantic import ValidationError
from support.crd_check import admit, apply_defaults, version_schema

from stage_operator import crdgen
from stage_operator.api import quantization as api
from stage_operator.api.spec import StageSpec
from stage_operator.builders.children import build_configmap
from stage_operator.builders.pod import template_hash
from stage_operator.builders.runtime_config import quantization_config, stage_config
from stage_operator.stage import parse_stage
from stage_runtime.config import QuantizationConfig, QuantizationMethod, load_config
from stage_runtime.config import quantization as runtime_quantization

CRD = crdgen.build_crd()
SCHEMA = version_schema(CRD)['properties']['spec']['properties']['quantization']
BASE = {'apiVersion': 'diffstage.io/v1alpha1', 'kind': 'DiffusionStage', 'metadata': {'name': 's'},
        'spec': {'model': {'builtin': 'tiny-sd'}}}
TP_WORDS = 'tensor parallel cuts full-precision weights; quantized weights are not sharded'


def stage(quantization, **spec) -> dict:
    obj = copy.deepcopy(BASE)
    obj['spec'].update(quantization=quantization, **spec)
    return obj


def parse(quantization, **spec) -> StageSpec:
    return StageSpec.model_validate(stage(quantization, **spec)['spec'])


def refused(quantization, **spec) -> str:
    with pytest.raises(ValidationError) as info:
        parse(quantization, **spec)
    return str(info.value)


def test_the_methods_and_the_default_are_the_runtimes():
    assert api.METHODS == get_args(QuantizationMethod) == ('none', 'fp8-storage', 'int8-weight', 'fp8', 'gguf')
    assert SCHEMA['properties']['method']['enum'] == list(get_args(QuantizationMethod))
    defaults = apply_defaults(version_schema(CRD), stage({}))['spec']['quantization']
    assert defaults == {'method': QuantizationConfig().method} == {'method': 'none'}
    q = parse({}).quantization
    assert (q.method, q.components, q.skip, q.file, q.enabled) == ('none', None, None, None, False)
    assert q.runtime() == QuantizationConfig()


def test_a_stage_without_quantization_has_none_and_its_wire_form_is_unchanged():
    spec = StageSpec.model_validate(BASE['spec'])
    assert spec.quantization is None and 'quantization' not in spec.wire()
    assert 'quantization' not in apply_defaults(version_schema(CRD), copy.deepcopy(BASE))['spec'], 'no default object'


def test_an_unknown_method_is_refused_by_the_schema_enum_and_by_the_operator():
    messages = admit(CRD, stage({'method': 'int4'}))
    assert len(messages) == 1 and 'spec.quantization.method' in messages[0] and 'int4' in messages[0], messages
    assert 'gguf' in messages[0], 'the message lists the supported values'
    text = refused({'method': 'int4'})
    assert 'quantization.method' in text and 'int4' in text


@pytest.mark.parametrize('quantization', [
    {'components': [f'c{n}' for n in range(api.MAX_COMPONENTS + 1)]}, {'components': ['text-encoder']},
    {'components': ['0unet']}, {'components': ['']}, {'components': 'unet'}, {'components': ['x' * 65]},
    {'skip': [f's{n}' for n in range(api.MAX_SKIP + 1)]}, {'skip': ['a' * (api.SKIP_MAX_LENGTH + 1)]},
    {'skip': ['']}, {'method': 'gguf', 'file': ''}, {'method': 'gguf', 'file': 'f' * (api.FILE_MAX_LENGTH + 1)},
    {'method': 'gguf', 'file': 7},
], ids=['components-too-many', 'component-hyphen', 'component-digit-first', 'component-empty',
        'components-not-a-list', 'component-too-long', 'skip-too-many', 'skip-too-long', 'skip-empty', 'file-empty',
        'file-too-long', 'file-not-a-string'])
def test_the_api_server_and_the_operator_refuse_out_of_range_values(quantization):
    assert admit(CRD, stage(quantization)), f'{quantization!r} must be refused by the schema'
    with pytest.raises(ValidationError):
        parse(quantization)


@pytest.mark.parametrize('name', ['transformer', 'unet', 'text_encoder_2', '_private', 'Transformer', 'x9',
                                  'text-encoder', '9x', 'a b', 'été', 'vae.decoder', ''])
def test_a_component_the_crd_admits_is_one_the_runtime_accepts(name):
    """The CRD's pattern is never wider than the runtime's identifier check (narrower only outside ASCII)."""
    crd_ok = re.fullmatch(api.COMPONENT_PATTERN.strip('^$'), name) is not None
    runtime_ok = runtime_quantization._IDENTIFIER.match(name) is not None
    assert not crd_ok or runtime_ok
    assert crd_ok == runtime_ok or not name.isascii()
    assert (admit(CRD, stage({'method': 'int8-weight', 'components': [name]})) == []) == crd_ok


@pytest.mark.parametrize('pattern', ['(', '[a-', '*ff', '(?P<x'])
def test_a_skip_that_is_no_python_regex_is_refused_by_the_operator_naming_field_and_value(pattern):
    """CEL cannot compile a Python regular expression: the API server admits it, the operator's parse refuses it
    (the stage is InvalidSpec, nothing is created) before a pod could exit 2 on it."""
    assert admit(CRD, stage({'method': 'int8-weight', 'skip': [pattern]})) == []
    text = refused({'method': 'int8-weight', 'skip': [r'\.ff\.', pattern]})
    assert f'quantization.skip {pattern!r} is not a Python regular expression' in text, text
    with pytest.raises(ValidationError):
        QuantizationConfig(method='int8-weight', skip=(pattern,))  # the runtime refuses it too


@pytest.mark.parametrize('quantization, words', [
    ({'method': 'gguf'}, 'quantization.method gguf needs file'),
    ({'file': 'd.gguf'}, 'quantization.file (d.gguf) applies only to method gguf, not none'),
    ({'method': 'fp8-storage', 'file': 'd.gguf'}, 'quantization.file (d.gguf) applies only to method gguf, not '
                                                  'fp8-storage'),
    ({'method': 'gguf', 'file': 'd.gguf', 'components': ['transformer']},
     'quantization.components (transformer) does not apply to method gguf'),
    ({'method': 'int8-weight', 'components': ['unet', 'unet']}, 'quantization.components lists unet twice'),
])
def test_each_cel_refusal_and_the_operators_name_the_field_and_the_value(quantization, words):
    assert [m.removeprefix('spec.quantization: ') for m in admit(CRD, stage(quantization))][0].startswith(words)
    assert words in refused(quantization)


@pytest.mark.parametrize('method', [m for m in api.METHODS if m != 'none'])
def test_a_method_with_tensor_parallel_is_refused_naming_both(method):
    extra = {'file': 'd.gguf'} if method == 'gguf' else {}
    spec = {'parallel': {'tensorParallelSize': 2}, 'resources': {'gpusPerPod': 2}}
    words = f'quantization.method {method} with parallel.tensorParallelSize 2: {TP_WORDS}'
    assert [m for m in admit(CRD, stage({'method': method, **extra}, **spec))] == [f'spec: {words} (use Ulysses, '
                                                                                   'ring or CFG parallel)']
    assert words in refused({'method': method, **extra}, **spec)
    assert admit(CRD, stage({'method': 'none'}, **spec)) == [] and parse({'method': 'none'}, **spec)


def test_an_unknown_field_is_an_error_naming_it_not_ignored():
    with pytest.raises(ValidationError, match='quantizationFile'):
        parse({'method': 'gguf', 'quantizationFile': 'd.gguf'})


SECTIONS = [
    ({'method': 'int8-weight'}, {'method': 'int8-weight'}),
    ({'method': 'fp8-storage', 'components': ['unet', 'text_encoder'], 'skip': [r'\.ff\.', '^down_blocks\\.0']},
     {'method': 'fp8-storage', 'components': ['unet', 'text_encoder'], 'skip': [r'\.ff\.', '^down_blocks\\.0']}),
    ({'method': 'fp8'}, {'method': 'fp8'}),
    ({'method': 'gguf', 'file': 'gguf/flux1-dev-Q4_K.gguf'}, {'method': 'gguf', 'file': 'gguf/flux1-dev-Q4_K.gguf'}),
]


@pytest.mark.parametrize('quantization, section', SECTIONS, ids=[s[0]['method'] for s in SECTIONS])
def test_the_runtime_section_is_what_the_spec_says_and_the_runtime_loads_it(quantization, section):
    spec = parse(quantization, resources={'gpuResourceName': ''})
    assert quantization_config(spec) == {'quantization': section}
    assert QuantizationConfig(**section) == spec.quantization.runtime()
    config = load_config(stage_config(spec, 's'))  # the runtime's StageConfig (its cross-section rules included)
    assert config.quantization == QuantizationConfig(**section) and config.quantization.enabled


def test_a_ulysses_stage_quantizes_and_the_runtime_accepts_its_config():
    spec = parse({'method': 'int8-weight'}, parallel={'ulyssesDegree': 2}, resources={'gpusPerPod': 2})
    config = load_config(stage_config(spec, 's'))
    assert config.quantization.method == 'int8-weight' and config.parallel.ulysses_degree == 2


def _stage(**spec):
    st = parse_stage({'metadata': {'name': 'tiny', 'namespace': 'team', 'uid': 'uid-9', 'generation': 3},
                      'spec': {'model': {'builtin': 'tiny-sd'}, 'resources': {'gpuResourceName': ''}, **spec}})
    assert st.spec is not None, st.error
    return st


@pytest.mark.parametrize('spec', [{}, {'quantization': {}}, {'quantization': {'method': 'none'}}],
                         ids=['absent', 'empty', 'method-none'])
def test_nothing_quantized_means_no_section_and_no_roll(spec):
    st = _stage(**spec)
    assert quantization_config(st.spec) == {}
    assert stage_config(st.spec, 'tiny') == stage_config(_stage().spec, 'tiny')
    stage_yaml = yaml.safe_load(build_configmap(st)['data']['stage.yaml'])
    assert 'quantization' not in stage_yaml and load_config(stage_yaml).quantization == QuantizationConfig()
    assert template_hash(st) == template_hash(_stage()), 'stages that quantize nothing are not rolled'


def test_a_changed_method_rolls_the_pods():
    hashes = {template_hash(_stage(**spec)) for spec in (
        {}, {'quantization': {'method': 'int8-weight'}}, {'quantization': {'method': 'fp8-storage'}},
        {'quantization': {'method': 'int8-weight', 'skip': ['ff']}})}
    assert len(hashes) == 4


def _described(node, path='quantization'):
    assert node.get('description', '').strip(), f'{path} has no description'
    for name, sub in (node.get('properties') or {}).items():
        yield from _described(sub, f'{path}.{name}')
    if isinstance(node.get('items'), dict):
        yield from _described(node['items'], f'{path}[]')
    yield path


def test_every_quantization_field_has_a_description_naming_its_devices():
    assert set(_described(SCHEMA)) == {'quantization', 'quantization.method', 'quantization.components',
                                       'quantization.components[]', 'quantization.skip', 'quantization.skip[]',
                                       'quantization.file'}
    method = SCHEMA['properties']['method']['description']
    assert 'compute capability 8.9' in method and 'CPU included' in method and 'Q4_K' in method
