"""The pod builder: names, labels, ownership, restart policy, GPU limits, probes, termination log, command."""
from __future__ import annotations

import argparse
import copy

import pytest
import yaml

from stage_operator.builders.children import build_configmap, build_service
from stage_operator.builders.pod import build_pod, template_hash
from stage_operator.stage import parse_stage
from stage_runtime.cli import add_engine_flags, config_from_args
from stage_runtime.config import load_config

OBJECT_STORE = {'objectStore': {'bucket': 'video-jobs', 'prefix': 'stages/tiny', 'endpoint': 'http://minio.storage:9000',
                                 'region': 'eu-west-1', 'credentialsSecret': 'jobs-s3'}, 'presignedContent': True}
BASE = {'model': {'builtin': 'tiny-sd'}, 'replicas': 2, 'parallel': {'cfgParallelSize': 2},
        'resources': {'gpusPerPod': 2, 'gpuResourceName': ''}, 'engine': {'executionMode': 'step', 'maxNumSeqs': 4}}


def stage(**spec):
    body = {'metadata': {'name': 'tiny', 'namespace': 'team', 'uid': 'uid-9', 'generation': 3},
            'spec': {**copy.deepcopy(BASE), **spec}}
    st = parse_stage(body)
    assert st.spec is not None, st.error
    return st


def container(pod):
    return pod['spec']['containers'][0]


@pytest.mark.parametrize('index', [0, 1, 7])
def test_name_labels_and_owner(index):
    st = stage()
    pod = build_pod(st, index)
    meta = pod['metadata']
    assert meta['name'] == f'tiny-{index}' and meta['namespace'] == 'team'
    assert meta['labels'] == {'diffstage.io/stage': 'tiny', 'diffstage.io/replica': str(index),
                              'diffstage.io/serving': 'true', 'diffstage.io/template-hash': template_hash(st),
                              'app.kubernetes.io/managed-by': 'diffstage-operator',
                              'llm-d.ai/engine-type': 'diffstage'}   # the endpoint picker's engineConfigs entry
    assert meta['ownerReferences'] == [{'apiVersion': 'diffstage.io/v1alpha1', 'kind': 'DiffusionStage', 'name': 'tiny',
                                        'uid': 'uid-9', 'controller': True, 'blockOwnerDeletion': True}]
    assert pod['spec']['restartPolicy'] == 'Never'


@pytest.mark.parametrize('resources, limits', [
    ({'gpusPerPod': 2, 'gpuResourceName': ''}, None),
    ({'gpusPerPod': 2, 'gpuResourceName': 'nvidia.com/gpu'}, {'nvidia.com/gpu': '2'}),
    ({'gpusPerPod': 2, 'gpuResourceName': 'amd.com/gpu', 'memory': '8Gi'}, {'amd.com/gpu': '2', 'memory': '8Gi'}),
    ({'gpusPerPod': 2}, {'nvidia.com/gpu': '2'}),  # the default resource name
])
def test_gpu_limits(resources, limits):
    assert container(build_pod(stage(resources=resources), 0))['resources'].get('limits') == limits


def test_probes_and_termination_message():
    c = container(build_pod(stage(), 0))
    assert c['startupProbe']['httpGet'] == {'path': '/ready', 'port': 'http'}
    assert c['readinessProbe']['httpGet'] == {'path': '/ready', 'port': 'http'}
    assert c['livenessProbe']['httpGet'] == {'path': '/health', 'port': 'http'}
    assert c['startupProbe']['failureThreshold'] * c['startupProbe']['periodSeconds'] >= 300, 'room to load weights'
    assert c['terminationMessagePath'] == '/dev/termination-log'
    assert [p['containerPort'] for p in c['ports']] == [8000, 5570]


@pytest.mark.parametrize('spec, expected', [
    ({}, ['--model', '/opt/diffstage/models/tiny-sd', '--device', 'cpu', '--num-gpus', '2', '--cfg-parallel-size', '2',
          '--executor', 'mp', '--execution-mode', 'step', '--max-num-seqs', '4']),
    ({'model': {'path': '/models/sd-turbo', 'name': 'turbo'}, 'resources': {'gpusPerPod': 2}},
     ['--model', '/models/sd-turbo', '--served-name', 'turbo', '--device', 'auto']),
    ({'parallel': {'ulyssesDegree': 2, 'tensorParallelSize': 2}, 'resources': {'gpusPerPod': 4, 'gpuResourceName': ''}},
     ['--tensor-parallel-size', '2', '--ulysses-degree', '2', '--num-gpus', '4']),
    ({'parallel': {}, 'resources': {'gpusPerPod': 1, 'gpuResourceName': ''}, 'engine': {'requestBatchMaxWaitMs': 20}},
     ['--executor', 'uni', '--request-batch-max-wait-ms', '20']),
    ({'engine': {'extraArgs': ['--max-waiting', '9']}}, ['--termination-log', '/dev/termination-log', '--max-waiting', '9']),
])
def test_serve_command_from_the_spec(spec, expected):
    cmd = container(build_pod(stage(**spec), 0))['command']
    assert cmd[:2] == ['stage-runtime', 'serve'] and '--termination-log' in cmd
    assert all(flag in cmd for flag in expected[::2])
    pairs = list(zip(cmd, cmd[1:]))
    for flag, value in zip(expected[::2], expected[1::2]):
        assert (flag, value) in pairs, (flag, value, cmd)


@pytest.mark.parametrize('spec', [
    {},
    {'model': {'path': '/models/dit', 'dtype': 'bfloat16'}, 'parallel': {'ulyssesDegree': 2, 'ringDegree': 2},
     'resources': {'gpusPerPod': 4}, 'engine': {'executionMode': 'request', 'maxNumSeqs': 8, 'maxWaiting': 32}},
    {'engine': {'streaming': True, 'executionMode': 'step'}},
    {'jobs': {'claimName': 'video-jobs', 'leaseSeconds': 12}},
    {'jobs': OBJECT_STORE},
])
def test_command_and_configmap_parse_with_the_runtime_cli(spec, tmp_path):
    """The runtime's own parser and config loader accept what the operator generates, and agree."""
    st = stage(**spec)
    config = yaml.safe_load(build_configmap(st)['data']['stage.yaml'])
    from_configmap = load_config(config)
    (tmp_path / 'stage.yaml').write_text(build_configmap(st)['data']['stage.yaml'])
    cmd = container(build_pod(st, 0))['command']
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args, serve_only = parser.parse_known_args(cmd[2:])
    assert serve_only[::2] == ['--host', '--http-port', '--zmq-port', '--drain-timeout', '--startup-timeout',
                              '--termination-log'] + (['--job-store'] if 'claimName' in spec.get('jobs', {}) else [])
    if 'claimName' in spec.get('jobs', {}):  # a serve flag too (a runner that maps mounts rewrites it), the same
        # folder as the config's; a bucket is no mount: the config alone names it
        assert serve_only[-1] == from_configmap.jobs.store and from_configmap.jobs.lease_s == 12.0
    args.config = str(tmp_path / 'stage.yaml')
    from_flags = config_from_args(args)
    assert from_flags == from_configmap
    assert from_flags.parallel.world_size == st.spec.resources.gpus_per_pod
    assert from_flags.model.path == cmd[cmd.index('--model') + 1]


def test_builtin_model_is_built_by_an_init_container_and_paths_are_not():
    builtin = build_pod(stage(), 0)['spec']
    assert builtin['initContainers'][0]['command'] == ['stage-runtime', 'make-tiny-model',
                                                       '/opt/diffstage/models/tiny-sd', '--kind', 'sd']
    assert 'initContainers' not in build_pod(stage(model={'path': '/m'}), 0)['spec']


@pytest.mark.parametrize('builtin, kind', [('tiny-sdxl', 'sdxl'), ('tiny-qwen-image', 'qwen-image')])
def test_family_builtins_map_to_their_tiny_kind(builtin, kind):
    from stage_runtime.models.tiny import KINDS

    spec = build_pod(stage(model={'builtin': builtin}), 0)['spec']
    assert spec['initContainers'][0]['command'] == ['stage-runtime', 'make-tiny-model',
                                                    f'/opt/diffstage/models/{builtin}', '--kind', kind]
    assert kind in KINDS


def test_pod_template_passthrough():
    tpl = {'nodeSelector': {'pool': 'gpu'}, 'tolerations': [{'key': 'gpu', 'operator': 'Exists'}],
           'env': [{'name': 'X', 'value': '1'}], 'volumes': [{'name': 'm', 'emptyDir': {}}],
           'volumeMounts': [{'name': 'm', 'mountPath': '/m'}], 'serviceAccountName': 'sa',
           'priorityClassName': 'high', 'imagePullSecrets': [{'name': 'regcred'}]}
    spec = build_pod(stage(podTemplate=tpl), 0)['spec']
    assert spec['nodeSelector'] == {'pool': 'gpu'} and spec['tolerations'] == tpl['tolerations']
    assert spec['serviceAccountName'] == 'sa' and spec['priorityClassName'] == 'high'
    assert spec['imagePullSecrets'] == [{'name': 'regcred'}]
    assert {'name': 'X', 'value': '1'} in spec['containers'][0]['env']
    assert spec['volumes'][-1] == {'name': 'm', 'emptyDir': {}}
    assert spec['containers'][0]['volumeMounts'][-1] == {'name': 'm', 'mountPath': '/m'}


@pytest.mark.parametrize('change, rolls', [
    ({'replicas': 5}, False), ({'restartPolicy': {'maxRestarts': 1}}, False),
    ({'autoscaling': {'mode': 'External'}}, False), ({'abort': {'id': 'a', 'all': True}}, False),
    ({'image': 'other:1'}, True), ({'engine': {'maxNumSeqs': 8}}, True), ({'engine': {'streaming': True,
                                                                                       'executionMode': 'step'}}, True),
    ({'podTemplate': {'nodeSelector': {'a': 'b'}}}, True), ({'autoscaling': {'drainTimeoutSeconds': 5}}, True),
])
def test_template_hash_moves_only_with_what_a_pod_runs(change, rolls):
    assert (template_hash(stage(**change)) != template_hash(stage())) == rolls


def test_service_selects_serving_pods_of_the_stage():
    svc = build_service(stage())
    assert svc['metadata']['name'] == 'tiny' and svc['metadata']['ownerReferences'][0]['uid'] == 'uid-9'
    assert svc['spec']['selector'] == {'diffstage.io/stage': 'tiny', 'diffstage.io/serving': 'true'}
    assert [(p['name'], p['port']) for p in svc['spec']['ports']] == [('http', 8000), ('zmq', 5570)]


@pytest.mark.parametrize('spec', [
    {},
    {'model': {'path': '/m'}, 'resources': {'gpusPerPod': 2, 'cpu': '4', 'memory': '16Gi', 'shmSize': '2Gi'},
     'podTemplate': {'nodeSelector': {'a': 'b'}, 'tolerations': [{'key': 'gpu', 'operator': 'Exists'}],
                     'env': [{'name': 'X', 'value': '1'}], 'imagePullSecrets': [{'name': 'r'}],
                     'serviceAccountName': 'sa', 'priorityClassName': 'p'}},
    {'jobs': OBJECT_STORE},
])
def test_children_validate_against_the_kubernetes_schemas(spec):
    """Strict: a misspelt field in a builder fails here instead of at the API server."""
    import kubernetes_validate

    from stage_operator.builders.event import build_event

    st = stage(**spec)
    for obj in (build_pod(st, 0), build_service(st), build_configmap(st),
                build_event(st, 'Normal', 'CreatedPods', 'created tiny-0', '2026-01-01T00:00:00Z')):
        kubernetes_validate.validate(obj, '1.29', strict=True)


def _builtins() -> tuple[str, ...]:
    import typing

    from stage_operator.api.spec import ModelSource

    literal = next(a for a in typing.get_args(ModelSource.model_fields['builtin'].annotation) if a is not type(None))
    return typing.get_args(literal)


@pytest.mark.parametrize('builtin', _builtins())
def test_every_builtin_model_is_a_tiny_kind_the_runtime_builds(builtin):
    """`tiny-X` runs `make-tiny-model --kind X`: X must be one of the runtime's tiny kinds (tiny-sd3, tiny-flux...)."""
    from stage_runtime.models.tiny import KINDS

    command = build_pod(stage(model={'builtin': builtin}), 0)['spec']['initContainers'][0]['command']
    assert command == ['stage-runtime', 'make-tiny-model', f'/opt/diffstage/models/{builtin}', '--kind',
                       builtin.removeprefix('tiny-')]
    assert command[-1] in KINDS
    assert {'tiny-sd3', 'tiny-flux'} <= set(_builtins())


COMPLETE_TEMPLATE = {
    'labels': {'kueue.x-k8s.io/queue-name': 'team-q', 'app': 'images'},
    'annotations': {'cluster-autoscaler.kubernetes.io/safe-to-evict': 'false'},
    'topologySpreadConstraints': [{'maxSkew': 1, 'topologyKey': 'topology.kubernetes.io/zone',
                                   'whenUnsatisfiable': 'ScheduleAnyway',
                                   'labelSelector': {'matchLabels': {'diffstage.io/stage': 'tiny'}}}],
    'schedulerName': 'volcano', 'runtimeClassName': 'nvidia',
    'resourceClaims': [{'name': 'gpus', 'resourceClaimTemplateName': 'two-gpus'}],
}


def test_the_complete_pod_template_reaches_the_pod():
    pod = build_pod(stage(podTemplate=COMPLETE_TEMPLATE), 1)
    meta, spec = pod['metadata'], pod['spec']
    assert meta['labels']['kueue.x-k8s.io/queue-name'] == 'team-q' and meta['labels']['app'] == 'images'
    assert meta['annotations'] == COMPLETE_TEMPLATE['annotations']
    assert spec['topologySpreadConstraints'] == COMPLETE_TEMPLATE['topologySpreadConstraints']
    assert spec['schedulerName'] == 'volcano' and spec['runtimeClassName'] == 'nvidia'
    assert spec['resourceClaims'] == COMPLETE_TEMPLATE['resourceClaims']
    assert container(pod)['resources']['claims'] == [{'name': 'gpus'}], 'the stage container claims the devices'


def test_operator_owned_fields_cannot_be_overridden():
    """Labels: the operator's win even past admission (which refuses them: test_validation); GPU limits, probes,
    the command and the restart policy have no podTemplate field at all (extra fields are refused)."""
    st = stage(podTemplate={'labels': {'app': 'x'}})
    owned = {'diffstage.io/stage': 'tiny', 'diffstage.io/replica': '0', 'diffstage.io/serving': 'true'}
    body = {'metadata': {'name': 'tiny', 'namespace': 'team', 'uid': 'uid-9'},
            'spec': {**copy.deepcopy(BASE), 'podTemplate': {'labels': {'diffstage.io/serving': 'false'}}}}
    refused = parse_stage(body)
    assert refused.spec is None and 'diffstage.io/serving belong to the operator' in refused.error
    for field, value in (('command', ['sh']), ('livenessProbe', {}), ('resources', {'limits': {}}),
                         ('restartPolicy', 'Always'), ('containers', [])):
        bad = parse_stage({**body, 'spec': {**copy.deepcopy(BASE), 'podTemplate': {field: value}}})
        assert bad.spec is None and f'unknown field spec.podTemplate.{field}' in bad.error, field
    assert owned.items() <= build_pod(st, 0)['metadata']['labels'].items()


def test_the_endpoint_picker_engine_label_is_a_default_the_template_may_override():
    assert build_pod(stage(), 0)['metadata']['labels']['llm-d.ai/engine-type'] == 'diffstage'
    mine = stage(podTemplate={'labels': {'llm-d.ai/engine-type': 'diffstage-v2'}})
    assert build_pod(mine, 0)['metadata']['labels']['llm-d.ai/engine-type'] == 'diffstage-v2'


def test_pod_template_labels_roll_the_pods():
    assert template_hash(stage(podTemplate={'labels': {'a': 'b'}})) != template_hash(stage())
    assert template_hash(stage(podTemplate={'annotations': {'a': 'b'}})) != template_hash(stage())


def test_auth_mounts_the_secret_and_passes_the_flag():
    pod = build_pod(stage(auth={'secretRef': {'name': 'stage-keys', 'key': 'keys.txt'}}), 0)
    volume = next(v for v in pod['spec']['volumes'] if v['name'] == 'api-keys')
    assert volume['secret'] == {'secretName': 'stage-keys', 'defaultMode': 0o444,
                                'items': [{'key': 'keys.txt', 'path': 'api-keys'}]}
    assert {'name': 'api-keys', 'mountPath': '/etc/diffstage-auth', 'readOnly': True} in container(pod)['volumeMounts']
    cmd = container(pod)['command']
    assert cmd[cmd.index('--api-key-file') + 1] == '/etc/diffstage-auth/api-keys'
    assert '--api-key-file' not in container(build_pod(stage(), 0))['command']
    assert stage(auth={'secretRef': {'name': 'k'}}).spec.auth.secret_ref.key == 'api-keys'


def test_auth_flag_parses_with_the_runtime_cli():
    from stage_runtime.cli import build_parser

    cmd = container(build_pod(stage(auth={'secretRef': {'name': 'k'}}), 0))['command']
    args = build_parser().parse_args(cmd[1:])
    assert args.api_key_file == '/etc/diffstage-auth/api-keys'


@pytest.mark.parametrize('version', ['1.29', '1.34'])
def test_the_complete_template_validates_against_the_kubernetes_schemas(version):
    import kubernetes_validate

    from stage_operator.builders.networkpolicy import build_network_policy

    tpl = {**COMPLETE_TEMPLATE, 'resourceClaims': []} if version == '1.29' else COMPLETE_TEMPLATE  # DRA: GA 1.34
    st = stage(podTemplate=tpl, auth={'secretRef': {'name': 'k'}},
               networkPolicy={'httpFrom': [{'namespaceSelector': {'matchLabels': {'team': 'web'}}}]})
    for obj in (build_pod(st, 0), build_network_policy(st)):
        kubernetes_validate.validate(obj, version, strict=True)


def test_spec_jobs_mounts_the_claim_read_write_where_the_stage_config_puts_the_store():
    pod = build_pod(stage(jobs={'claimName': 'video-jobs'}), 0)
    volumes = {v['name']: v for v in pod['spec']['volumes']}
    assert volumes['jobs-store'] == {'name': 'jobs-store', 'persistentVolumeClaim': {'claimName': 'video-jobs'}}
    mounts = [m for m in container(pod)['volumeMounts'] if m['name'] == 'jobs-store']
    store = load_config(yaml.safe_load(build_configmap(stage(jobs={'claimName': 'video-jobs'}))['data']['stage.yaml']))
    assert mounts == [{'name': 'jobs-store', 'mountPath': store.jobs.store}], 'read-write, at the configured store'
    assert pod['spec']['securityContext']['fsGroup'] == 65532, 'the claim is writable by the stage user'
    plain = build_pod(stage(), 0)
    assert 'jobs-store' not in {v['name'] for v in plain['spec']['volumes']}


def aws_env(pod) -> dict:
    return {e['name']: e for e in container(pod)['env'] if e['name'].startswith('AWS_')}


def test_an_object_store_passes_the_secrets_aws_keys_by_name_and_mounts_nothing():
    st = stage(jobs=OBJECT_STORE)
    pod = build_pod(st, 0)
    ref = {'name': 'jobs-s3'}
    assert aws_env(pod) == {
        'AWS_ACCESS_KEY_ID': {'name': 'AWS_ACCESS_KEY_ID',
                              'valueFrom': {'secretKeyRef': {**ref, 'key': 'AWS_ACCESS_KEY_ID'}}},
        'AWS_SECRET_ACCESS_KEY': {'name': 'AWS_SECRET_ACCESS_KEY',
                                  'valueFrom': {'secretKeyRef': {**ref, 'key': 'AWS_SECRET_ACCESS_KEY'}}},
        'AWS_SESSION_TOKEN': {'name': 'AWS_SESSION_TOKEN',
                              'valueFrom': {'secretKeyRef': {**ref, 'key': 'AWS_SESSION_TOKEN', 'optional': True}}},
    }, 'each key by name (no envFrom: no other key of the Secret reaches the process); the token optional'
    assert not any('envFrom' in c for c in pod['spec']['containers'] + pod['spec'].get('initContainers', []))
    assert 'jobs-store' not in {v['name'] for v in pod['spec']['volumes']}
    assert not any(m['mountPath'] == '/var/lib/diffstage/jobs' for m in container(pod)['volumeMounts'])
    assert '--job-store' not in container(pod)['command']
    for init in pod['spec'].get('initContainers', []):  # the model builder never sees the credentials
        assert not any(e['name'].startswith('AWS_') for e in init.get('env', [])), init['name']
    jobs = load_config(yaml.safe_load(build_configmap(st)['data']['stage.yaml'])).jobs
    assert (jobs.store, jobs.endpoint, jobs.region, jobs.presigned_content) == (
        's3://video-jobs/stages/tiny', 'http://minio.storage:9000', 'eu-west-1', True)


def test_an_object_store_without_a_secret_runs_on_the_service_accounts_identity():
    sa = {'podTemplate': {'serviceAccountName': 'video-jobs-irsa'}}
    pod = build_pod(stage(jobs={'objectStore': {'bucket': 'video-jobs'}}, **sa), 0)
    assert aws_env(pod) == {}, 'no static keys: the SDK finds IRSA / EKS Pod Identity'
    assert pod['spec']['serviceAccountName'] == 'video-jobs-irsa'
    assert 'jobs-store' not in {v['name'] for v in pod['spec']['volumes']}
    assert aws_env(build_pod(stage(jobs={'claimName': 'video-jobs'}), 0)) == {} and aws_env(build_pod(stage(), 0)) == {}


@pytest.mark.parametrize('change', [
    {'credentialsSecret': 'other'}, {'bucket': 'other-bucket'}, {'prefix': 'b'}, {'endpoint': 'https://s3.example'},
    {'region': 'us-east-1'}])
def test_the_template_hash_moves_with_the_object_store(change):
    before = stage(jobs=OBJECT_STORE)
    after = stage(jobs={**OBJECT_STORE, 'objectStore': {**OBJECT_STORE['objectStore'], **change}})
    assert template_hash(after) != template_hash(before)
