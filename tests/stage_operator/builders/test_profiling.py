"""spec.profiling reaches the pod (builders.pod, builders.runtime_config): a volume `profiles` mounted read-write in
the stage container at the stage config's profiler.dir, an emptyDir unless a claim is named, never a hostPath (the
restricted Pod Security level admits every case); without spec.profiling no volume and no section."""
from __future__ import annotations

import copy

import pytest
import yaml
from support.psa_restricted import violations

from stage_operator.builders.children import build_configmap
from stage_operator.builders.pod import build_pod
from stage_operator.stage import parse_stage
from stage_runtime.config import load_config

BASE = {'model': {'builtin': 'tiny-sd'}, 'replicas': 1, 'resources': {'gpusPerPod': 1, 'gpuResourceName': ''}}
DIR = '/var/lib/diffstage/profiles'


def stage(**spec):
    st = parse_stage({'metadata': {'name': 'p', 'namespace': 'team', 'uid': 'u', 'generation': 1},
                      'spec': {**copy.deepcopy(BASE), **copy.deepcopy(spec)}})
    assert st.spec is not None, st.error
    return st


def volumes(pod) -> dict[str, dict]:
    return {v['name']: v for v in pod['spec']['volumes']}


def stage_mounts(pod) -> dict[str, dict]:
    return {m['mountPath']: m for m in pod['spec']['containers'][0]['volumeMounts']}


CASES = [
    ('default', {}, {'emptyDir': {}}),
    ('empty-dir', {'volume': {'emptyDir': {}}}, {'emptyDir': {}}),
    ('empty-dir-limited', {'volume': {'emptyDir': {'sizeLimit': '2Gi'}}}, {'emptyDir': {'sizeLimit': '2Gi'}}),
    ('claim', {'volume': {'pvc': {'claimName': 'traces'}}}, {'persistentVolumeClaim': {'claimName': 'traces'}}),
]


@pytest.mark.parametrize('profiling, source', [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_traces_volume_is_mounted_where_the_stage_config_writes_them(profiling, source):
    st = stage(profiling=profiling)
    pod = build_pod(st, 0)
    assert volumes(pod)['profiles'] == {'name': 'profiles', **source}
    assert stage_mounts(pod)[DIR] == {'name': 'profiles', 'mountPath': DIR}, 'read-write'
    config = load_config(yaml.safe_load(build_configmap(st)['data']['stage.yaml']))
    assert config.profiler.dir == DIR and config.profiler.enabled
    for init in pod['spec'].get('initContainers') or ():
        assert all(m['name'] != 'profiles' for m in init['volumeMounts']), 'only the stage profiles'


@pytest.mark.parametrize('profiling', [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_restricted_pod_security_admits_every_case(profiling):
    assert violations(build_pod(stage(profiling=profiling), 0)) == []


def test_without_profiling_no_volume_and_no_mount():
    pod = build_pod(stage(), 0)
    assert 'profiles' not in volumes(pod) and DIR not in stage_mounts(pod)
    assert 'profiler' not in yaml.safe_load(build_configmap(stage())['data']['stage.yaml'])


def test_sleep_needs_no_volume():
    pod, plain = build_pod(stage(sleep={'afterIdle': '5s'}), 0), build_pod(stage(), 0)
    assert volumes(pod) == volumes(plain) and pod['spec']['containers'][0]['command'] == \
        plain['spec']['containers'][0]['command'], 'sleep mode is in the stage config only'
