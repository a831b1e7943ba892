"""How spec.model reaches the pod (builders.model_delivery): per source the volumes, mounts, init containers
and `--model`; every pod validates against the Kubernetes schemas; the init commands parse with the
runtime's own CLI; the startup probe follows startupTimeoutSeconds."""
from __future__ import annotations

import copy

import pytest

from stage_operator.builders.pod import build_pod, template_hash
from stage_operator.stage import parse_stage
from stage_runtime.cli import build_parser
from stage_runtime.fetch.command import FetchArgs

SHA = 'ab' * 32
URI = {'url': 'https://models.example/tiny.tar.gz', 'sha256': SHA}
BASE = {'replicas': 1, 'resources': {'gpusPerPod': 1, 'gpuResourceName': ''}}


def stage(model, **spec):
    body = {'metadata': {'name': 'm', 'namespace': 'team', 'uid': 'u', 'generation': 1},
            'spec': {**copy.deepcopy(BASE), 'model': model, **spec}}
    st = parse_stage(body)
    assert st.spec is not None, st.error
    return st


def model_arg(pod):
    cmd = pod['spec']['containers'][0]['command']
    return cmd[cmd.index('--model') + 1]


def mounts(container):
    return {m['mountPath']: m for m in container.get('volumeMounts') or ()}


def volumes(pod):
    return {v['name']: v for v in pod['spec']['volumes']}


# (id, spec.model, cluster has image volumes, expected --model, init container names)
CASES = [
    ('pvc', {'source': {'pvc': {'claimName': 'models', 'subPath': 'sd/tiny'}}}, False,
     '/opt/diffstage/model-source', []),
    ('image-volume', {'source': {'image': {'reference': 'reg.example/tiny:1', 'pullPolicy': 'IfNotPresent'}},
                      'imageVolume': 'always'}, False, '/opt/diffstage/model-image', []),
    ('image-auto-on-new-cluster', {'source': {'image': {'reference': 'reg.example/tiny:1'}}}, True,
     '/opt/diffstage/model-image', []),
    ('image-init-copy', {'source': {'image': {'reference': 'reg.example/tiny:1', 'path': '/data/model'}},
                         'imageVolume': 'never'}, True, '/opt/diffstage/model-image', ['copy-model']),
    ('image-auto-on-old-cluster', {'source': {'image': {'reference': 'reg.example/tiny:1'}}}, False,
     '/opt/diffstage/model-image', ['copy-model']),
    ('uri', {'source': {'uri': URI}}, False, '/opt/diffstage/model/pipeline', ['fetch-model']),
    ('uri-host-cache', {'source': {'uri': URI}, 'cache': {'hostPath': '/var/lib/diffstage', 'maxBytes': 10 ** 11}},
     False, '/opt/diffstage/model/pipeline', ['fetch-model']),
    ('uri-pvc-cache', {'source': {'uri': URI}, 'cache': {'pvc': {'claimName': 'cache'}, 'maxBytes': 10 ** 11}},
     False, '/opt/diffstage/model/pipeline', ['fetch-model']),
    ('builtin', {'builtin': 'tiny-sd'}, False, '/opt/diffstage/models/tiny-sd', ['make-model']),
]


@pytest.mark.parametrize('model, image_volumes, model_dir, inits', [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_source_builds_a_pod_that_validates(model, image_volumes, model_dir, inits):
    import kubernetes_validate

    pod = build_pod(stage(model), 0, image_volumes=image_volumes)
    kubernetes_validate.validate(pod, '1.35', strict=True)
    assert model_arg(pod) == model_dir
    assert [c['name'] for c in pod['spec'].get('initContainers') or ()] == inits
    stage_mounts = mounts(pod['spec']['containers'][0])
    assert any(model_dir == p or model_dir.startswith(p + '/') for p in stage_mounts), 'the model is mounted'


def test_pvc_is_mounted_read_only_at_the_fixed_path_with_its_sub_path():
    pod = build_pod(stage({'source': {'pvc': {'claimName': 'models', 'subPath': 'sd/tiny'}}}), 0)
    assert volumes(pod)['model-source'] == {'name': 'model-source',
                                           'persistentVolumeClaim': {'claimName': 'models', 'readOnly': True}}
    assert mounts(pod['spec']['containers'][0])['/opt/diffstage/model-source'] == {
        'name': 'model-source', 'mountPath': '/opt/diffstage/model-source', 'readOnly': True, 'subPath': 'sd/tiny'}


def test_image_volume_and_its_init_container_fallback_serve_the_same_folder():
    source = {'image': {'reference': 'reg.example/tiny@sha256:' + SHA, 'path': '/models'}}
    volume = build_pod(stage({'source': source, 'imageVolume': 'always'}), 0)
    assert volumes(volume)['model-image'] == {'name': 'model-image', 'image': {'reference': source['image']['reference']}}
    assert mounts(volume['spec']['containers'][0])['/opt/diffstage/model-image']['subPath'] == 'models'
    copy_ = build_pod(stage({'source': source, 'imageVolume': 'never'}), 0)
    init = copy_['spec']['initContainers'][0]
    assert init['image'] == source['image']['reference']
    assert init['command'] == ['cp', '-R', '/models/.', '/opt/diffstage/model-image']
    assert volumes(copy_)['model-image'] == {'name': 'model-image', 'emptyDir': {}}
    assert mounts(copy_['spec']['containers'][0])['/opt/diffstage/model-image']['readOnly'] is True
    assert model_arg(volume) == model_arg(copy_)


@pytest.mark.parametrize('cache, volume', [
    (None, None),
    ({'hostPath': '/var/lib/diffstage', 'maxBytes': 5}, {'hostPath': {'path': '/var/lib/diffstage',
                                                                      'type': 'DirectoryOrCreate'}}),
    ({'pvc': {'claimName': 'c'}, 'maxBytes': 5}, {'persistentVolumeClaim': {'claimName': 'c'}}),
])
def test_fetch_model_command_parses_with_the_runtime_cli(cache, volume):
    model = {'source': {'uri': URI}, **({'cache': cache} if cache else {})}
    pod = build_pod(stage(model), 0)
    init = pod['spec']['initContainers'][0]
    assert init['image'] == pod['spec']['containers'][0]['image'] and init['command'][:2] == ['stage-runtime',
                                                                                               'fetch-model']
    assert init['terminationMessagePath'] == '/dev/termination-log'
    args = build_parser().parse_args(init['command'][1:])
    req = FetchArgs(url=args.url, dir=args.dir, sha256=args.sha256, cache=args.cache, max_bytes=args.max_bytes)
    assert (req.url, req.dir, req.sha256) == (URI['url'], model_arg(pod), SHA)
    if cache is None:
        assert req.cache is None and 'model-cache' not in volumes(pod)
        return
    assert req.cache == '/var/cache/diffstage' and req.max_bytes == 5
    assert {k: v for k, v in volumes(pod)['model-cache'].items() if k != 'name'} == volume
    for container in (init, pod['spec']['containers'][0]):  # the stage follows the link and holds the lock
        assert '/var/cache/diffstage' in mounts(container)


@pytest.mark.parametrize('budget', [1, 10, 29, 30, 600, 1800, 86400])
def test_the_startup_probe_and_the_stage_follow_startup_timeout_seconds(budget):
    pod = build_pod(stage({'builtin': 'tiny-sd'}, startupTimeoutSeconds=budget), 0)
    container = pod['spec']['containers'][0]
    probe = container['startupProbe']
    window = probe['periodSeconds'] * probe['failureThreshold']
    assert budget < window <= budget + 3 * probe['periodSeconds'], probe  # the stage's own verdict comes first
    cmd = container['command']
    assert cmd[cmd.index('--startup-timeout') + 1] == str(budget)
    args = build_parser().parse_args(cmd[1:])
    assert args.startup_timeout == budget


def test_the_template_hash_follows_the_source():
    a = template_hash(stage({'source': {'uri': URI}}))
    b = template_hash(stage({'source': {'uri': {**URI, 'sha256': 'cd' * 32}}}))
    c = template_hash(stage({'source': {'image': {'reference': 'r:1'}}}), image_volumes=True)
    d = template_hash(stage({'source': {'image': {'reference': 'r:1'}}}), image_volumes=False)
    assert len({a, b, c, d}) == 4
