"""How the local cluster maps a pod onto this machine: the operator's own pod for the tiny sample, rewritten."""
from __future__ import annotations

import copy
import shutil
import sys
from pathlib import Path

import pytest

from e2e import scenario
from e2e.local.pod_process import LocalPod, LocalSources, PodSpecError
from e2e.local.pod_runner import PodRunner
from stage_operator.builders.children import build_configmap
from stage_operator.builders.pod import build_pod
from stage_operator.stage import parse_stage


@pytest.fixture
def stage():
    manifest = scenario.sample()
    manifest['metadata'].update(namespace='default', uid='uid-1', generation=1)
    return parse_stage(manifest)


def local(pod, tmp_path, configmaps):
    pod['metadata']['uid'] = 'pod-uid'
    return LocalPod(pod, '127.9.0.2', lambda ns, name: configmaps.get(name), tmp_path)


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
    with pytest.raises(PodSpecError, match='configmap "tiny-config" not found'):
        local(pod, tmp_path, {})
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
    lp = LocalPod(pod, '127.9.0.2', lambda ns, name: configmaps.get(name), tmp_path, sources)
    main = pod['spec']['containers'][0]
    assert lp.rewrite(model_dir, lp.path_map(main)) == str(claim / 'sd')
    pod, model_dir = pod_for({'source': {'image': {'reference': 'reg/tiny:1'}}}, image_volumes=True)
    lp = LocalPod(pod, '127.9.0.2', lambda ns, name: configmaps.get(name), tmp_path, sources)
    assert lp.rewrite(model_dir, lp.path_map(pod['spec']['containers'][0])) == str(image / 'models')
    pod, model_dir = pod_for({'source': {'image': {'reference': 'reg/tiny:1'}}, 'imageVolume': 'never'})
    lp = LocalPod(pod, '127.9.0.2', lambda ns, name: configmaps.get(name), tmp_path, sources)
    copy_argv = lp.argv(pod['spec']['initContainers'][0])
    target = lp.rewrite(model_dir, lp.path_map(pod['spec']['containers'][0]))
    assert copy_argv == ['cp', '-R', f'{image}/models/.', target]
    uri = {'url': 'http://127.0.0.1:1/m.tgz', 'sha256': 'ab' * 32}
    pod, _ = pod_for({'source': {'uri': uri}, 'cache': {'hostPath': '/var/cache/m', 'maxBytes': 1}})
    lp = LocalPod(pod, '127.9.0.2', lambda ns, name: configmaps.get(name), tmp_path, sources)
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
