"""spec.loras → the stage's startup adapters (stage.yaml), rolled by the template hash, accepted by the runtime."""

from __future__ import annotations

import copy

import pytest
import yaml

from stage_operator.builders.children import build_configmap
from stage_operator.builders.pod import template_hash
from stage_operator.stage import parse_stage
from stage_runtime.config import load_config

BASE = {'model': {'builtin': 'tiny-sd'}, 'replicas': 1, 'resources': {'gpusPerPod': 1, 'gpuResourceName': ''}}
LORAS = [{'name': 'pixel-art', 'path': '/adapters/pixel'}, {'name': 'ink', 'path': '/adapters/ink.safetensors',
                                                            'pinned': False}]


def stage(**spec):
    st = parse_stage({'metadata': {'name': 'tiny', 'namespace': 'team', 'uid': 'uid-9', 'generation': 3},
                      'spec': {**copy.deepcopy(BASE), **spec}})
    assert st.spec is not None, st.error
    return st


def test_spec_loras_become_the_stage_startup_adapters():
    config = load_config(yaml.safe_load(build_configmap(stage(loras=LORAS, maxLoras=4))['data']['stage.yaml']))
    assert [(s.name, s.path, s.pinned) for s in config.loras] == [('pixel-art', '/adapters/pixel', True),
                                                                   ('ink', '/adapters/ink.safetensors', False)]
    assert config.max_loras == 4
    assert load_config(yaml.safe_load(build_configmap(stage())['data']['stage.yaml'])).loras == ()


def test_changing_the_list_rolls_the_pods():
    hashes = {template_hash(stage(**spec)) for spec in ({}, {'loras': LORAS}, {'loras': LORAS[:1]})}
    assert len(hashes) == 3
    assert template_hash(stage(loras=LORAS)) == template_hash(stage(loras=copy.deepcopy(LORAS)))


@pytest.mark.parametrize('lora, field', [({'name': '../x', 'path': '/a'}, 'name'), ({'name': 'a', 'path': ''}, 'path')])
def test_bad_adapters_are_refused_naming_the_field(lora, field):
    st = parse_stage({'metadata': {'name': 'tiny', 'namespace': 'team', 'uid': 'u', 'generation': 1},
                      'spec': {**copy.deepcopy(BASE), 'loras': [lora]}})
    assert st.spec is None and f'loras.0.{field}' in st.error
