"""spec.sleep and spec.profiling (api/sleep.py): defaults and bounds are the runtime's SleepConfig's and
ProfilerConfig's, the API server (schema + CEL) and the operator's parse refuse the same values naming the field and
the value, the sections builders.runtime_config writes load into the runtime's StageConfig, and a stage without them
keeps its stage config and template hash. More CEL cases: SLEEP_CASES in test_validation.py."""
from __future__ import annotations

import copy

import pytest
import yaml
from pydantic import ValidationError
from support.crd_check import admit, apply_defaults, version_schema

from stage_operator import crdgen
from stage_operator.api.sleep import AFTER_IDLE_MAX_S, duration_seconds
from stage_operator.api.spec import StageSpec
from stage_operator.builders.children import build_configmap
from stage_operator.builders.pod import template_hash
from stage_operator.builders.runtime_config import profiler_config, sleep_config, stage_config
from stage_operator.stage import parse_stage
from stage_runtime.config import ProfilerConfig, SleepConfig, load_config

CRD = crdgen.build_crd()
SPEC = version_schema(CRD)['properties']['spec']['properties']
BASE = {'apiVersion': 'diffstage.io/v1alpha1', 'kind': 'DiffusionStage', 'metadata': {'name': 's'},
        'spec': {'model': {'builtin': 'tiny-sd'}, 'resources': {'gpuResourceName': ''}}}


def stage(**fields) -> dict:
    obj = copy.deepcopy(BASE)
    obj['spec'].update(copy.deepcopy(fields))
    return obj


def parse(**fields) -> StageSpec:
    return StageSpec.model_validate(stage(**fields)['spec'])


def refused(**fields) -> str:
    with pytest.raises(ValidationError) as info:
        parse(**fields)
    return str(info.value)


def _bounds(model, field):
    out = {}
    for m in model.model_fields[field].metadata:
        for name in ('ge', 'gt', 'le'):
            if hasattr(m, name):
                out[name] = getattr(m, name)
    return out


# -- defaults and bounds: the runtime's ------------------------------------------------------------------------
def test_sleep_defaults_are_the_runtimes_and_the_api_server_fills_them():
    s = parse(sleep={}).sleep
    runtime = SleepConfig()
    assert (s.after_idle, s.level, s.drain_timeout_seconds, s.wake_timeout_seconds) == (
        None, runtime.level, runtime.drain_timeout_s, runtime.wake_timeout_s)
    assert s.runtime() == SleepConfig(enabled=True)
    defaults = apply_defaults(version_schema(CRD), stage(sleep={}))['spec']['sleep']
    assert defaults == {'level': 1, 'drainTimeoutSeconds': 30, 'wakeTimeoutSeconds': 120}


def test_profiling_defaults_are_the_runtimes_and_the_volume_is_an_empty_dir_unless_named():
    p = parse(profiling={}).profiling
    runtime = ProfilerConfig()
    assert (p.max_seconds, p.record_shapes, p.profile_memory, p.volume) == (
        runtime.max_seconds, runtime.record_shapes, runtime.profile_memory, None)
    defaults = apply_defaults(version_schema(CRD), stage(profiling={}))['spec']['profiling']
    assert defaults == {'maxSeconds': 60, 'recordShapes': False, 'profileMemory': False}, 'no volume object added'


def test_the_bounds_are_the_runtimes():
    props = SPEC['sleep']['properties']
    assert props['level']['enum'] == [1, 2]
    drain, wake = _bounds(SleepConfig, 'drain_timeout_s'), _bounds(SleepConfig, 'wake_timeout_s')
    assert (props['drainTimeoutSeconds']['minimum'], props['drainTimeoutSeconds']['maximum']) == (drain['ge'],
                                                                                                  drain['le'])
    assert (props['wakeTimeoutSeconds']['minimum'], props['wakeTimeoutSeconds']['maximum']) == (1, wake['le'])
    assert AFTER_IDLE_MAX_S == _bounds(SleepConfig, 'after_idle_s')['le']
    seconds = SPEC['profiling']['properties']['maxSeconds']
    assert (seconds['minimum'], seconds['maximum']) == (1, _bounds(ProfilerConfig, 'max_seconds')['le'])


def test_absent_means_none_and_no_default_object():
    spec = parse()
    assert spec.sleep is None and spec.profiling is None
    assert 'sleep' not in spec.wire() and 'profiling' not in spec.wire()
    defaulted = apply_defaults(version_schema(CRD), stage())['spec']
    assert 'sleep' not in defaulted and 'profiling' not in defaulted


# -- durations -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize('text, seconds', [('5s', 5), ('10m', 600), ('1h30m', 5400), ('2h', 7200), ('90s', 90),
                                           ('1h1m1s', 3661), ('168h', 604800), ('0010m', 600)])
def test_a_duration_is_whole_hours_minutes_and_seconds(text, seconds):
    assert duration_seconds(text) == seconds
    assert admit(CRD, stage(sleep={'afterIdle': text})) == []
    assert parse(sleep={'afterIdle': text}).sleep.runtime().after_idle_s == float(seconds)


@pytest.mark.parametrize('text', ['10', '10min', '1.5h', '1d', '30m1h', '-5s', '5 s', 'h', '', '5S', '300ms'])
def test_a_bad_duration_is_refused_by_the_schema_and_by_the_operator_naming_field_and_value(text):
    messages = admit(CRD, stage(sleep={'afterIdle': text}))
    assert messages and all('spec.sleep.afterIdle' in m for m in messages), messages
    text_refused = refused(sleep={'afterIdle': text})
    assert 'afterIdle' in text_refused and repr(text).strip("'") in text_refused
    with pytest.raises(ValueError, match='not a duration'):
        duration_seconds(text)


@pytest.mark.parametrize('text', ['0s', '0h0m0s', '169h', '10081m', '604801s'])
def test_out_of_range_durations_are_refused_by_cel_and_the_operator_with_the_same_words(text):
    words = (f'sleep.afterIdle {text} is out of range: more than 0s and at most 168h (a duration such as 10m, 90s or '
             '1h30m)')
    assert admit(CRD, stage(sleep={'afterIdle': text})) == [f'spec.sleep: {words}']
    assert words in refused(sleep={'afterIdle': text})


# -- other refusals ------------------------------------------------------------------------------------------
@pytest.mark.parametrize('fields, name, value', [
    ({'sleep': {'level': 3}}, 'level', '3'), ({'sleep': {'level': 0}}, 'level', '0'),
    ({'sleep': {'drainTimeoutSeconds': -1}}, 'drainTimeoutSeconds', '-1'),
    ({'sleep': {'drainTimeoutSeconds': 3601}}, 'drainTimeoutSeconds', '3601'),
    ({'sleep': {'wakeTimeoutSeconds': 0}}, 'wakeTimeoutSeconds', '0'),
    ({'sleep': {'wakeTimeoutSeconds': 3601}}, 'wakeTimeoutSeconds', '3601'),
    ({'sleep': {'afterIdle': 300}}, 'afterIdle', '300'),
    ({'profiling': {'maxSeconds': 0}}, 'maxSeconds', '0'),
    ({'profiling': {'maxSeconds': 3601}}, 'maxSeconds', '3601'),
    ({'profiling': {'volume': {'pvc': {'claimName': ''}}}}, 'claimName', "''"),
    ({'profiling': {'volume': {'hostPath': {'path': '/tmp'}}}}, 'hostPath', 'hostPath'),
], ids=['level-3', 'level-0', 'drain-negative', 'drain-long', 'wake-0', 'wake-long', 'after-idle-number',
        'max-seconds-0', 'max-seconds-long', 'claim-empty', 'host-path'])
def test_out_of_range_values_are_refused_by_both_naming_field_and_value(fields, name, value):
    assert admit(CRD, stage(**fields)), f'{fields!r} must be refused by the schema'
    text = refused(**fields)
    assert name in text and value in text, text


def test_the_profiling_volume_refusals_name_the_fields():
    for volume in ({}, {'emptyDir': {}, 'pvc': {'claimName': 'p'}}):
        assert admit(CRD, stage(profiling={'volume': volume})) == [
            'spec.profiling.volume: profiling.volume: set exactly one of emptyDir or pvc']
        assert 'profiling.volume: set exactly one of emptyDir or pvc' in refused(profiling={'volume': volume})


def test_an_unknown_field_is_an_error_naming_it_not_ignored():
    assert 'afterIdleSeconds' in refused(sleep={'afterIdleSeconds': 60})
    assert 'dir' in refused(profiling={'dir': '/tmp/p'})


# -- the stage config the runtime loads ------------------------------------------------------------------------
def test_the_sleep_section_is_what_the_spec_says_and_the_runtime_loads_it():
    spec = parse(sleep={'afterIdle': '10m', 'level': 2, 'drainTimeoutSeconds': 5, 'wakeTimeoutSeconds': 300})
    section = {'enabled': True, 'level': 2, 'after_idle_s': 600.0, 'drain_timeout_s': 5.0, 'wake_timeout_s': 300.0}
    assert sleep_config(spec) == {'sleep': section}
    config = load_config(stage_config(spec, 's'))  # the runtime's StageConfig, its cross-section rules included
    assert config.sleep == SleepConfig(**section)
    on_demand = load_config(stage_config(parse(sleep={}), 's')).sleep
    assert on_demand.enabled and on_demand.after_idle_s is None and on_demand.level == 1


def test_the_profiler_section_writes_to_the_mounted_folder_and_the_runtime_loads_it():
    spec = parse(profiling={'maxSeconds': 20, 'recordShapes': True, 'profileMemory': True,
                            'volume': {'pvc': {'claimName': 'traces'}}})
    section = {'dir': '/var/lib/diffstage/profiles', 'max_seconds': 20.0, 'record_shapes': True,
               'profile_memory': True}
    assert profiler_config(spec) == {'profiler': section}
    config = load_config(stage_config(spec, 's'))
    assert config.profiler == ProfilerConfig(**section) and config.profiler.enabled


def _stage(**fields):
    st = parse_stage({'metadata': {'name': 'tiny', 'namespace': 'team', 'uid': 'uid-9', 'generation': 3},
                      'spec': stage(**fields)['spec']})
    assert st.spec is not None, st.error
    return st


def test_absent_leaves_the_stage_config_and_the_template_hash_as_they_were():
    plain = _stage()
    data = yaml.safe_load(build_configmap(plain)['data']['stage.yaml'])
    assert 'sleep' not in data and 'profiler' not in data
    assert sleep_config(plain.spec) == {} and profiler_config(plain.spec) == {}
    config = load_config(data)
    assert config.sleep == SleepConfig() and config.profiler == ProfilerConfig(), 'the runtime defaults: off'
    hashes = {template_hash(_stage(**fields)) for fields in (
        {}, {'sleep': {}}, {'sleep': {'afterIdle': '5s'}}, {'profiling': {}},
        {'profiling': {'volume': {'pvc': {'claimName': 'p'}}}})}
    assert len(hashes) == 5, 'each is a startup setting: it rolls the pods (and only a stage that sets it)'
    assert template_hash(_stage()) == template_hash(plain)
