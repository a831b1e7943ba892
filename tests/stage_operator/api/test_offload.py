"""spec.offload (api/offload.py): its modes are the runtime's OffloadMode, the section it writes loads into the runtime's
StageConfig (DLO's topology rules included), what the runtime would refuse at startup the operator refuses first, and
a stage without it gets the stage config it had. The CEL refusals are cases of test_validation.py (OFFLOAD_CASES:
each rule exercised, the operator's words the same)."""
from __future__ import annotations

import copy
from typing import get_args

import pytest
import yaml
from pydantic import ValidationError
from support.crd_check import admit, apply_defaults, version_schema

from stage_operator import crdgen
from stage_operator.api import offload as api
from stage_operator.api.spec import StageSpec
from stage_operator.builders.children import build_configmap
from stage_operator.builders.pod import template_hash
from stage_operator.builders.runtime_config import offload_config, serve_command, stage_config
from stage_operator.stage import parse_stage
from stage_runtime.config import OffloadConfig, OffloadMode, dlo_refusal, load_config

CRD = crdgen.build_crd()
SCHEMA = version_schema(CRD)['properties']['spec']['properties']['offload']
DP2 = {'parallel': {'dataParallelSize': 2}, 'resources': {'gpusPerPod': 2, 'gpuResourceName': ''}}


def body(offload, **spec) -> dict:
    return {'apiVersion': 'diffstage.io/v1alpha1', 'kind': 'DiffusionStage', 'metadata': {'name': 's'},
            'spec': {'model': {'builtin': 'tiny-sd'}, 'offload': offload, **copy.deepcopy(spec)}}


def parse(offload, **spec) -> StageSpec:
    return StageSpec.model_validate(body(offload, **spec)['spec'])


def refused(offload, **spec) -> str:
    with pytest.raises(ValidationError) as info:
        parse(offload, **spec)
    return str(info.value)


def test_the_modes_and_the_defaults_are_the_runtimes():
    assert api.MODES == get_args(OffloadMode) == ('none', 'model', 'layerwise', 'distributed')
    assert SCHEMA['properties']['mode']['enum'] == list(api.MODES)
    defaults = apply_defaults(version_schema(CRD), body({}))['spec']['offload']
    assert defaults == {'mode': 'none', 'residentLayers': 2, 'prefetch': True, 'allgather': True}
    assert parse({}).offload.runtime() == OffloadConfig()


def test_a_stage_without_offload_has_none_and_its_config_is_unchanged():
    spec = StageSpec.model_validate(body({})['spec'] | {'offload': None})
    assert spec.offload is None and 'offload' not in spec.wire() and offload_config(spec) == {}
    assert 'offload' not in apply_defaults(version_schema(CRD), {'spec': {'model': {'builtin': 'tiny-sd'}}})['spec']


def test_dlo_on_two_data_parallel_ranks_is_a_section_the_runtime_loads_as_dlo():
    spec = parse({'mode': 'distributed'}, **DP2)
    assert admit(CRD, body({'mode': 'distributed'}, **DP2)) == []
    assert offload_config(spec) == {'offload': {'mode': 'distributed', 'resident_layers': 2, 'prefetch': True,
                                                'allgather': True}}
    config = load_config(stage_config(spec, 's'))
    assert config.offload.dlo and config.parallel.dp_size == 2 and dlo_refusal(config) is None
    assert '--data-parallel-size' in serve_command(spec, 's')


def test_the_rank_local_variant_and_layerwise_are_sections_the_runtime_loads():
    local = parse({'mode': 'distributed', 'allgather': False, 'prefetch': False, 'residentLayers': 1})
    assert offload_config(local) == {'offload': {'mode': 'distributed', 'resident_layers': 1, 'prefetch': False,
                                                 'allgather': False}}
    config = load_config(stage_config(local, 's'))
    assert config.offload.per_rank_mode == 'layerwise' and not config.offload.dlo
    model = parse({'mode': 'model', 'components': ['text_encoder', 'vae']})
    assert offload_config(model) == {'offload': {'mode': 'model', 'components': ['text_encoder', 'vae']}}
    assert load_config(stage_config(model, 's')).offload.components == ('text_encoder', 'vae')


@pytest.mark.parametrize('offload, spec, words', [
    ({'mode': 'layerwise'}, {'compile': {'mode': 'regional'}},
     "compile.mode='regional' with offload.mode='layerwise'"),
    ({'mode': 'layerwise'}, {'quantization': {'method': 'int8-weight'}},
     "quantization.method='int8-weight' with offload.mode='layerwise'"),
    ({'mode': 'model'}, {'sleep': {}}, "sleep.enabled with offload.mode='model'"),
    ({'mode': 'layerwise', 'prefetch': True, 'residentLayers': 1}, {}, 'resident_layers=1 must be >= 2'),
], ids=['layerwise-compile', 'layerwise-quantized', 'model-sleep', 'one-resident-layer-with-prefetch'])
def test_what_the_runtime_refuses_at_startup_the_operator_refuses_at_parse(offload, spec, words):
    """CEL does not carry these (the API server admits them); the operator's parse uses the runtime's own check, so
    the stage is InvalidSpec and no pod exits 2 on it."""
    assert words in refused(offload, **spec)


def test_a_component_name_the_crd_refuses_and_an_unknown_field_is_named():
    assert admit(CRD, body({'mode': 'model', 'components': ['text-encoder']}))
    with pytest.raises(ValidationError, match='allGather'):
        parse({'mode': 'distributed', 'allGather': False}, **DP2)


def _stage(**spec):
    st = parse_stage({'metadata': {'name': 'tiny', 'namespace': 'team', 'uid': 'uid-9', 'generation': 3},
                      'spec': {'model': {'builtin': 'tiny-sd'}, 'resources': {'gpuResourceName': ''}, **spec}})
    assert st.spec is not None, st.error
    return st


@pytest.mark.parametrize('spec', [{}, {'offload': {}}, {'offload': {'mode': 'none'}}],
                         ids=['absent', 'empty', 'mode-none'])
def test_nothing_offloaded_means_no_section_and_no_roll(spec):
    st = _stage(**spec)
    stage_yaml = yaml.safe_load(build_configmap(st)['data']['stage.yaml'])
    assert 'offload' not in stage_yaml and load_config(stage_yaml).offload == OffloadConfig()
    assert template_hash(st) == template_hash(_stage())


def test_a_dlo_stage_is_invalid_spec_naming_the_rule_not_a_pod_that_exits_2():
    st = parse_stage({'metadata': {'name': 'tiny', 'namespace': 'team', 'uid': 'u', 'generation': 1},
                      'spec': {'model': {'builtin': 'tiny-sd'}, 'offload': {'mode': 'distributed'}}})
    assert st.spec is None and 'offload.mode distributed with parallel.dataParallelSize 1' in st.error


def test_a_changed_mode_rolls_the_pods():
    hashes = {template_hash(_stage(**spec)) for spec in (
        {}, {'offload': {'mode': 'layerwise'}}, {'offload': {'mode': 'model'}},
        {'offload': {'mode': 'distributed'}, 'parallel': {'dataParallelSize': 2}, 'resources': {
            'gpusPerPod': 2, 'gpuResourceName': ''}})}
    assert len(hashes) == 4
