"""spec.compile reaches the pod (builders.compile_cache, builders.runtime_config): the stage.yaml's `compile:` section the
runtime accepts, and for each of the three places the artifacts can live (compile.cache, a folder of model.cache, an
emptyDir) the volume and the stage container's mount at cache_dir; the restricted Pod Security level admits every
case but a hostPath the user named; the node model cache's eviction leaves the compile folder alone."""
from __future__ import annotations

import copy

import pytest
import yaml
from support.psa_restricted import violations

from stage_operator.builders.children import build_configmap
from stage_operator.builders.pod import build_pod, template_hash
from stage_operator.stage import parse_stage
from stage_runtime.config import load_config
from stage_runtime.fetch.cache import ModelCache

SHA = 'ab' * 32
URI = {'source': {'uri': {'url': 'https://models.example/tiny.tar.gz', 'sha256': SHA}}}
BASE = {'model': {'builtin': 'tiny-sd'}, 'replicas': 1, 'resources': {'gpusPerPod': 1, 'gpuResourceName': ''}}
REGIONAL = {'mode': 'regional', 'shapes': ['64x64', '32x32x17'], 'maxGraphs': 8, 'timeoutSeconds': 120}


def stage(**spec):
    st = parse_stage({'metadata': {'name': 'c', 'namespace': 'team', 'uid': 'u', 'generation': 1},
                      'spec': {**copy.deepcopy(BASE), **copy.deepcopy(spec)}})
    assert st.spec is not None, st.error
    return st


def stage_yaml(st) -> dict:
    return yaml.safe_load(build_configmap(st)['data']['stage.yaml'])


def container_mounts(pod) -> dict[str, dict]:
    return {m['mountPath']: m for m in pod['spec']['containers'][0]['volumeMounts']}


def volumes(pod) -> dict[str, dict]:
    return {v['name']: v for v in pod['spec']['volumes']}


# (id, spec fields, cache_dir in stage.yaml, the compile-cache volume without its name (None: none of its own),
#  the mount holding cache_dir: (volume name, mountPath))
CASES = [
    ('host-path', {'compile': {**REGIONAL, 'cache': {'hostPath': '/var/lib/compiled'}}}, '/var/cache/diffstage-compile',
     {'hostPath': {'path': '/var/lib/compiled', 'type': 'DirectoryOrCreate'}},
     ('compile-cache', '/var/cache/diffstage-compile')),
    ('claim', {'compile': {**REGIONAL, 'cache': {'pvc': {'claimName': 'compiled'}}}}, '/var/cache/diffstage-compile',
     {'persistentVolumeClaim': {'claimName': 'compiled'}}, ('compile-cache', '/var/cache/diffstage-compile')),
    ('claim-wins-over-model-cache', {'model': {**URI, 'cache': {'hostPath': '/var/cache/m', 'maxBytes': 10 ** 9}},
                                     'compile': {**REGIONAL, 'cache': {'pvc': {'claimName': 'compiled'}}}},
     '/var/cache/diffstage-compile', {'persistentVolumeClaim': {'claimName': 'compiled'}},
     ('compile-cache', '/var/cache/diffstage-compile')),
    ('model-cache-host-path', {'model': {**URI, 'cache': {'hostPath': '/var/cache/m', 'maxBytes': 10 ** 9}},
                               'compile': REGIONAL}, '/var/cache/diffstage/compile', None,
     ('model-cache', '/var/cache/diffstage')),
    ('model-cache-claim', {'model': {**URI, 'cache': {'pvc': {'claimName': 'models'}, 'maxBytes': 10 ** 9}},
                           'compile': REGIONAL}, '/var/cache/diffstage/compile', None,
     ('model-cache', '/var/cache/diffstage')),
    ('empty-dir', {'compile': REGIONAL}, '/var/cache/diffstage-compile', {'emptyDir': {}},
     ('compile-cache', '/var/cache/diffstage-compile')),
    ('uri-without-cache', {'model': URI, 'compile': REGIONAL}, '/var/cache/diffstage-compile', {'emptyDir': {}},
     ('compile-cache', '/var/cache/diffstage-compile')),
]


@pytest.mark.parametrize('spec, cache_dir, volume, holder', [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_stage_compiles_into_a_folder_its_container_mounts(spec, cache_dir, volume, holder):
    import kubernetes_validate

    st = stage(**spec)
    section = stage_yaml(st)['compile']
    assert section == {'mode': 'regional', 'cache_dir': cache_dir, 'shapes': ['64x64', '32x32x17'], 'max_graphs': 8,
                       'timeout_s': 120.0}
    config = load_config(stage_yaml(st))  # the runtime's own parse of the ConfigMap
    assert (config.compile.mode, config.compile.cache_dir, config.compile.shapes) == (
        'regional', cache_dir, ('64x64', '32x32x17'))
    pod = build_pod(st, 0)
    kubernetes_validate.validate(pod, '1.35', strict=True)
    if volume is None:
        assert 'compile-cache' not in volumes(pod), 'the model cache volume holds it: no volume of its own'
    else:
        assert {k: v for k, v in volumes(pod)['compile-cache'].items() if k != 'name'} == volume
    name, path = holder
    mount = container_mounts(pod)[path]
    assert mount['name'] == name and not mount.get('readOnly') and not mount.get('subPath'), mount
    assert cache_dir == path or cache_dir.startswith(path + '/'), 'cache_dir is inside the mount'
    for init in pod['spec'].get('initContainers') or ():
        assert all(m['name'] != 'compile-cache' for m in init['volumeMounts']), 'only the stage compiles'


@pytest.mark.parametrize('spec', [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_restricted_admits_every_case_but_a_host_path_the_user_named(spec):
    found = violations(build_pod(stage(**spec), 0))
    named = [f'volume {v}: hostPath volumes are forbidden' for v in ('model-cache', 'compile-cache')
             if v in _host_path_volumes(spec)]
    assert [v for v in found if 'hostPath volumes are forbidden' in v] == named
    if not named:
        assert found == []


def _host_path_volumes(spec) -> set[str]:
    out = set()
    if 'hostPath' in ((spec.get('model') or {}).get('cache') or {}):
        out.add('model-cache')
    if 'hostPath' in (spec['compile'].get('cache') or {}):
        out.add('compile-cache')
    return out


@pytest.mark.parametrize('spec', [{}, {'compile': {'mode': 'none'}},
                                  {'compile': {'mode': 'none', 'cache': {'pvc': {'claimName': 'compiled'}}}}],
                         ids=['no-compile', 'mode-none', 'mode-none-with-a-cache'])
def test_nothing_compiled_means_no_section_no_volume_and_no_roll(spec):
    st = stage(**spec)
    assert 'compile' not in stage_yaml(st) and load_config(stage_yaml(st)).compile.mode == 'none'
    pod = build_pod(st, 0)
    assert 'compile-cache' not in volumes(pod)
    assert template_hash(st) == template_hash(stage()), 'stages that compile nothing are not rolled'


def test_the_section_leaves_out_shapes_not_given_and_every_change_rolls_the_pods():
    assert stage_yaml(stage(compile={'mode': 'auto'}))['compile'] == {
        'mode': 'auto', 'cache_dir': '/var/cache/diffstage-compile', 'max_graphs': 64, 'timeout_s': 900.0}
    hashes = {template_hash(stage(**spec)) for spec in (
        {}, {'compile': {'mode': 'auto'}}, {'compile': {'mode': 'full'}}, {'compile': REGIONAL},
        {'compile': {**REGIONAL, 'shapes': ['64x64']}}, {'compile': {**REGIONAL, 'maxGraphs': 9}},
        {'compile': {**REGIONAL, 'cache': {'pvc': {'claimName': 'compiled'}}}})}
    assert len(hashes) == 7


def test_the_model_caches_eviction_neither_counts_nor_removes_the_compile_folder(tmp_path):
    """What the model-cache case relies on: stage_runtime.fetch.cache sizes and evicts only its models/ entries."""
    cache = ModelCache(tmp_path).ensure()
    for digest, at in (('a' * 64, 1000.0), ('b' * 64, 2000.0)):
        entry = cache.entry(digest)
        entry.mkdir()
        (entry / 'weights.bin').write_bytes(b'w' * 100)
        cache.touch(digest, at=at)
    compiled = tmp_path / 'compile' / 'inductor'
    compiled.mkdir(parents=True)
    (compiled / 'graph.so').write_bytes(b'g' * 10_000)
    result = cache.evict(max_bytes=100, grace_s=0.0, now=10_000.0)
    assert result.removed == ['a' * 64] and result.total_bytes == 100, 'the 10 kB of compile/ are not counted'
    assert (compiled / 'graph.so').read_bytes() == b'g' * 10_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ['.diffstage-model-cache', 'compile', 'locks', 'models',
                                                          'tmp']
