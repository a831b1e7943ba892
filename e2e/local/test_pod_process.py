"""How the local cluster maps a pod onto this machine: the operator's own pod for the tiny sample, rewritten."""
from __future__ import annotations

import base64
import copy
import shutil
import stat
import sys
from pathlib import Path

import pytest

from e2e import scenario
from e2e.local.pod_process import LocalPod, LocalSources, NotReady, PodSpecError
from e2e.local.pod_runner import PodRunner
from stage_operator.builders.children import build_configmap
from stage_operator.builders.pod import build_pod
from stage_operator.stage import parse_stage


@pytest.fixture
def stage():
    manifest = scenario.sample()
    manifest['metadata'].update(namespace='default', uid='uid-1', generation=1)
    return parse_stage(manifest)


def reader(configmaps=None, secrets=None):
    """`LocalPod`'s read(plural, namespace, name) over dicts of objects by name."""
    objects = {'configmaps': configmaps or {}, 'secrets': secrets or {}}
    return lambda plural, namespace, name: objects[plural].get(name)


def local(pod, tmp_path, configmaps, secrets=None):
    pod['metadata']['uid'] = 'pod-uid'
    lp = LocalPod(pod, '127.9.0.2', reader(configmaps, secrets), tmp_path)
    lp.mount()
    return lp


def test_the_tiny_pod_runs_as_local_processes(stage, tmp_path):
    pod = build_pod(stage, 1)
    configmap = build_configmap(stage)
    lp = local(pod, tmp_path, {configmap['metadata']['name']: configmap})
    init, main = pod['spec']['initContainers'][0], pod['spec']['containers'][0]
    make, serve = lp.argv(init), lp.argv(main)
    assert make[:3] == serve[:3] == [sys.executable, '-m', 'stage_runtime']
    model = serve[serve.index('--model') + 1]
    assert make[4] == model and model.startswith(str(lp.sandbox)), 'the init container writes where serve reads'
    assert serve[serve.index('--host') + 1] == '127.9.0.2'
    assert serve[serve.index('--http-port') + 1] == '8000', 'container ports are kept: the pod has its own address'
    config = serve[serve.index('--config') + 1]
    assert open(config).read() == next(iter(configmap['data'].values())), 'the ConfigMap volume holds its keys'
    assert serve[serve.index('--termination-log') + 1] == str(lp.termination_path(main))
    env = lp.env(main)
    assert env['DIFFSTAGE_REPLICA'] == '1' and env['DIFFSTAGE_STAGE'] == 'tiny' and env['HF_HUB_OFFLINE'] == '1'


def test_shm_is_the_hosts(stage, tmp_path):
    pod = build_pod(stage, 0)
    configmap = build_configmap(stage)
    lp = local(pod, tmp_path, {configmap['metadata']['name']: configmap})
    assert lp.volumes['dshm'] is None and '/dev/shm' not in lp.path_map(pod['spec']['containers'][0])


def test_what_cannot_run_locally_is_refused_by_name(stage, tmp_path):
    configmap = build_configmap(stage)
    configmaps = {configmap['metadata']['name']: configmap}
    pod = build_pod(stage, 0)
    pod['spec']['volumes'].append({'name': 'models', 'nfs': {'server': 'n', 'path': '/m'}})
    with pytest.raises(PodSpecError, match="volume 'models'"):
        local(copy.deepcopy(pod), tmp_path, configmaps)
    pod = build_pod(stage, 0)
    pod['spec']['volumes'].append({'name': 'models', 'persistentVolumeClaim': {'claimName': 'm'}})
    with pytest.raises(PodSpecError, match="persistentVolumeClaim 'm' is not bound"):
        local(copy.deepcopy(pod), tmp_path, configmaps)
    pod = build_pod(stage, 0)
    node = {'name': 'NODE', 'valueFrom': {'fieldRef': {'fieldPath': 'spec.nodeName'}}}
    pod['spec']['containers'][0]['env'].append(node)
    lp = local(pod, tmp_path, configmaps)
    with pytest.raises(PodSpecError, match="fieldRef 'spec.nodeName'"):
        lp.env(pod['spec']['containers'][0])


def test_each_pod_gets_a_loopback_address_whose_ports_are_free():
    import socket

    from e2e.local.pod_runner import loopback_addresses

    addresses = loopback_addresses()
    first = next(addresses)
    taken = first.rsplit('.', 1)[0] + '.' + str(int(first.rsplit('.', 1)[1]) + 1)
    with socket.socket() as server:
        server.bind((taken, 5570))  # someone else holds the next address's ZMQ port
        server.listen()
        following = next(addresses)
    assert first.startswith('127.') and following not in (first, taken)


def test_claims_images_and_host_paths_are_local_folders(tmp_path):
    """Model delivery (issue 18): a pvc source, an image volume, the init-container copy out of an image
    (its own files are the image's folder), and a hostPath cache shared by the node's pods."""
    from stage_operator.builders.model_delivery import model_delivery

    claim, image = tmp_path / 'claim', tmp_path / 'image'
    (claim / 'sd').mkdir(parents=True)
    (image / 'models').mkdir(parents=True)
    sources = LocalSources({'models': claim}, {'reg/tiny:1': image}, tmp_path / 'node')

    def pod_for(model, image_volumes=False):
        st = parse_stage({'metadata': {'name': 'm', 'namespace': 'default', 'uid': 'u', 'generation': 1},
                          'spec': {'model': model, 'resources': {'gpusPerPod': 1, 'gpuResourceName': ''}}})
        return build_pod(st, 0, image_volumes=image_volumes), model_delivery(st.spec, image_volumes).model_dir

    configmaps = {'m-config': {'data': {}}}
    pod, model_dir = pod_for({'source': {'pvc': {'claimName': 'models', 'subPath': 'sd'}}})
    lp = LocalPod(pod, '127.9.0.2', reader(configmaps), tmp_path, sources)
    lp.mount()
    main = pod['spec']['containers'][0]
    assert lp.rewrite(model_dir, lp.path_map(main)) == str(claim / 'sd')
    pod, model_dir = pod_for({'source': {'image': {'reference': 'reg/tiny:1'}}}, image_volumes=True)
    lp = LocalPod(pod, '127.9.0.2', reader(configmaps), tmp_path, sources)
    lp.mount()
    assert lp.rewrite(model_dir, lp.path_map(pod['spec']['containers'][0])) == str(image / 'models')
    pod, model_dir = pod_for({'source': {'image': {'reference': 'reg/tiny:1'}}, 'imageVolume': 'never'})
    lp = LocalPod(pod, '127.9.0.2', reader(configmaps), tmp_path, sources)
    lp.mount()
    copy_argv = lp.argv(pod['spec']['initContainers'][0])
    target = lp.rewrite(model_dir, lp.path_map(pod['spec']['containers'][0]))
    assert copy_argv == ['cp', '-R', f'{image}/models/.', target]
    uri = {'url': 'http://127.0.0.1:1/m.tgz', 'sha256': 'ab' * 32}
    pod, _ = pod_for({'source': {'uri': uri}, 'cache': {'hostPath': '/var/cache/m', 'maxBytes': 1}})
    lp = LocalPod(pod, '127.9.0.2', reader(configmaps), tmp_path, sources)
    lp.mount()
    fetch = lp.argv(pod['spec']['initContainers'][0])
    assert fetch[fetch.index('--cache') + 1] == str(tmp_path / 'node' / 'var' / 'cache' / 'm')


def test_a_relative_workdir_gives_every_pod_absolute_paths(tmp_path, monkeypatch):
    """Regression: `make cluster` passes --workdir .cluster; each pod runs with its own sandbox as working
    directory, so the runner's root (volumes, config files, the node's disk) must not stay relative."""
    monkeypatch.chdir(tmp_path)
    Path('.cluster').mkdir()
    runner = PodRunner('http://127.0.0.1:9', root=Path('.cluster'))
    try:
        assert runner.root.is_absolute() and runner.root.parent == tmp_path / '.cluster', runner.root
        assert runner.sources.node_root.is_absolute()
    finally:
        runner.api.close()
        shutil.rmtree(runner.root)


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_a_secret_volume_holds_the_key_file_serve_reads(tmp_path):
    """spec.auth: the operator mounts the Secret's key as the one file `--api-key-file` names, mode 0444."""
    manifest = scenario.with_spec(scenario.sample(), auth={'secretRef': {'name': 'stage-keys'}})
    manifest['metadata'].update(namespace='default', uid='uid-1', generation=1)
    st = parse_stage(manifest)
    pod, configmap = build_pod(st, 0), build_configmap(st)
    secret = {'data': {'api-keys': b64('sk-one\nsk-two\n'), 'other': b64('not mounted')}}
    lp = local(pod, tmp_path, {configmap['metadata']['name']: configmap}, {'stage-keys': secret})
    serve = lp.argv(pod['spec']['containers'][0])
    key_file = Path(serve[serve.index('--api-key-file') + 1])
    assert key_file.read_text() == 'sk-one\nsk-two\n' and key_file.is_relative_to(lp.sandbox)
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o444
    assert sorted(p.name for p in key_file.parent.iterdir()) == ['api-keys'], 'items: only the key asked for'


def test_a_missing_secret_configmap_or_key_keeps_the_pod_waiting_in_the_kubelets_words(tmp_path):
    def pod_with(volume):
        return {'metadata': {'name': 'p', 'namespace': 'default', 'uid': 'u'},
                'spec': {'containers': [{'name': 'c', 'command': ['true'],
                                         'volumeMounts': [{'name': volume['name'], 'mountPath': '/keys'}]}],
                         'volumes': [volume]}}

    keys = {'name': 'keys', 'secret': {'secretName': 's', 'items': [{'key': 'k', 'path': 'sub/k', 'mode': 0o400}]}}
    lp = LocalPod(pod_with(keys), '127.9.0.2', reader(), tmp_path)
    with pytest.raises(NotReady) as missing:
        lp.mount()
    assert (missing.value.reason, missing.value.message) == (
        'FailedMount', 'MountVolume.SetUp failed for volume "keys" : secret "s" not found')
    lp.read = reader(secrets={'s': {'data': {'other': b64('x')}}})
    with pytest.raises(NotReady, match='MountVolume.SetUp failed for volume "keys" : references non-existent '
                                       'secret key: k'):
        lp.mount()
    lp.read = reader(secrets={'s': {'data': {'k': b64('v')}}})
    lp.mount()  # the Secret appeared: the next try mounts it
    assert (lp.volumes['keys'] / 'sub' / 'k').read_text() == 'v'
    assert stat.S_IMODE((lp.volumes['keys'] / 'sub' / 'k').stat().st_mode) == 0o400
    optional = {'name': 'keys', 'secret': {'secretName': 's', 'optional': True}}
    lp = LocalPod(pod_with(optional), '127.9.0.2', reader(), tmp_path)
    lp.mount()
    assert list(lp.volumes['keys'].iterdir()) == [], 'optional and missing: an empty volume'
    config = {'name': 'cfg', 'configMap': {'name': 'cm', 'items': [{'key': 'a', 'path': 'a.txt'}]}}
    lp = LocalPod(pod_with(config), '127.9.0.2', reader(), tmp_path)
    with pytest.raises(NotReady, match='volume "cfg" : configmap "cm" not found'):
        lp.mount()
    lp.read = reader(configmaps={'cm': {'data': {'b': '1'}}})
    with pytest.raises(NotReady, match='configmap references non-existent config key: a'):
        lp.mount()
    escape = {'name': 'keys', 'secret': {'secretName': 's', 'items': [{'key': 'k', 'path': '../k'}]}}
    lp = LocalPod(pod_with(escape), '127.9.0.2', reader(secrets={'s': {'data': {'k': b64('v')}}}), tmp_path)
    with pytest.raises(PodSpecError, match=r"volume 'keys': items\[\].path '../k' must be relative"):
        lp.mount()


def test_env_from_secrets_and_configmaps_as_a_kubelet_sets_it(tmp_path):
    container = {'name': 'c', 'command': ['true'],
                 'envFrom': [{'configMapRef': {'name': 'cm'}, 'prefix': 'CM_'}, {'secretRef': {'name': 'gone',
                                                                                             'optional': True}}],
                 'env': [{'name': 'TOKEN', 'valueFrom': {'secretKeyRef': {'name': 's', 'key': 'token'}}},
                         {'name': 'MODE', 'valueFrom': {'configMapKeyRef': {'name': 'cm', 'key': 'mode'}}},
                         {'name': 'MAYBE', 'valueFrom': {'secretKeyRef': {'name': 's', 'key': 'no',
                                                                          'optional': True}}}]}
    pod = {'metadata': {'name': 'p', 'namespace': 'ns', 'uid': 'u'}, 'spec': {'containers': [container]}}
    lp = LocalPod(pod, '127.9.0.2', reader(configmaps={'cm': {'data': {'mode': 'fast'}}}), tmp_path)
    with pytest.raises(NotReady) as missing:
        lp.env(container)
    assert (missing.value.reason, missing.value.message) == ('CreateContainerConfigError', 'secret "s" not found')
    lp.read = reader(configmaps={'cm': {'data': {'mode': 'fast'}}}, secrets={'s': {'data': {}}})
    with pytest.raises(NotReady, match="couldn't find key token in Secret ns/s"):
        lp.env(container)
    lp.read = reader(configmaps={'cm': {'data': {'mode': 'fast'}}}, secrets={'s': {'data': {'token': b64('t0k')}}})
    env = lp.env(container)
    assert (env['TOKEN'], env['MODE'], env['CM_mode']) == ('t0k', 'fast', 'fast') and 'MAYBE' not in env
