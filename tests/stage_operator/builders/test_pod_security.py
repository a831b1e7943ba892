"""Stage pods run `restricted`: every pod the builder makes passes the Pod Security Standards check (written from
the published rules list: support/psa_restricted.py), and the check itself fails the pods it should."""
from __future__ import annotations

import copy

import pytest
from support.psa_restricted import violations

from stage_operator.builders.pod import build_pod
from stage_operator.stage import parse_stage

BASE = {'model': {'builtin': 'tiny-sd'}, 'replicas': 2, 'parallel': {'cfgParallelSize': 2},
        'resources': {'gpusPerPod': 2, 'gpuResourceName': ''}}
URI = {'url': 'https://models.example/tiny.tar.gz', 'sha256': 'ab' * 32}


def stage(**spec):
    st = parse_stage({'metadata': {'name': 'tiny', 'namespace': 'team', 'uid': 'u', 'generation': 1},
                      'spec': {**copy.deepcopy(BASE), **spec}})
    assert st.spec is not None, st.error
    return st


SPECS = {
    'builtin': {},
    'path-gpu': {'model': {'path': '/models/sd'}, 'resources': {'gpusPerPod': 2}},
    'pvc': {'model': {'source': {'pvc': {'claimName': 'models', 'subPath': 'sd'}}}},
    'uri': {'model': {'source': {'uri': URI}}},
    'uri-cache-pvc': {'model': {'source': {'uri': URI}, 'cache': {'pvc': {'claimName': 'c'}, 'maxBytes': 10}}},
    'image-copied': {'model': {'source': {'image': {'reference': 'reg/m:1'}}, 'imageVolume': 'never'}},
    'auth': {'auth': {'secretRef': {'name': 'keys'}}},
    'jobs': {'jobs': {'claimName': 'video-jobs'}},
    'jobs-object-store': {'jobs': {'objectStore': {'bucket': 'video-jobs', 'credentialsSecret': 'jobs-s3'},
                                   'presignedContent': True}},
    'template': {'podTemplate': {'labels': {'kueue.x-k8s.io/queue-name': 'q'}, 'schedulerName': 'volcano',
                                 'runtimeClassName': 'nvidia', 'volumes': [{'name': 'x', 'emptyDir': {}}],
                                 'resourceClaims': [{'name': 'gpu', 'resourceClaimTemplateName': 'gpus'}]}},
    'tightened': {'podTemplate': {'securityContext': {'seccompProfile': {'type': 'Localhost',
                                                                          'localhostProfile': 'stage.json'}},
                                  'containerSecurityContext': {'runAsUser': 1001}}},
}


@pytest.mark.parametrize('name', SPECS)
def test_every_built_pod_passes_the_restricted_profile(name):
    pod = build_pod(stage(**SPECS[name]), 0)
    assert violations(pod) == []
    assert pod['spec']['securityContext']['runAsNonRoot'] is True


def test_the_defaults_and_a_read_only_root_with_tmp_writable_in_every_container():
    spec = build_pod(stage(), 0)['spec']
    assert spec['securityContext'] == {'runAsNonRoot': True, 'runAsUser': 65532, 'runAsGroup': 65532,
                                       'fsGroup': 65532, 'seccompProfile': {'type': 'RuntimeDefault'}}
    volumes = {v['name']: v for v in spec['volumes']}
    assert volumes['stage-tmp'] == {'name': 'stage-tmp', 'emptyDir': {}}
    assert volumes['dshm']['emptyDir'] == {'medium': 'Memory'}
    for c in spec['initContainers'] + spec['containers']:
        assert c['securityContext'] == {'allowPrivilegeEscalation': False, 'capabilities': {'drop': ['ALL']},
                                        'readOnlyRootFilesystem': True}, c['name']
        assert {'name': 'stage-tmp', 'mountPath': '/tmp'} in c['volumeMounts'], c['name']
    stage_mounts = {m['mountPath'] for m in spec['containers'][0]['volumeMounts']}
    assert {'/tmp', '/dev/shm', '/opt/diffstage/models'} <= stage_mounts, 'where the stage writes'


def test_pod_template_security_contexts_merge_over_the_defaults():
    spec = build_pod(stage(podTemplate={'securityContext': {'runAsUser': 1000, 'fsGroup': 2000},
                                        'containerSecurityContext': {'readOnlyRootFilesystem': False}}), 0)['spec']
    assert spec['securityContext']['runAsUser'] == 1000 and spec['securityContext']['fsGroup'] == 2000
    assert spec['securityContext']['runAsNonRoot'] is True, 'what the user did not set stays restricted'
    c = spec['containers'][0]['securityContext']
    assert c['readOnlyRootFilesystem'] is False and c['capabilities'] == {'drop': ['ALL']}


@pytest.mark.parametrize('template, broken', [
    ({'securityContext': {'runAsNonRoot': False}}, 'runAsNonRoot must be true'),
    ({'securityContext': {'runAsUser': 0}}, 'runAsUser must not be 0'),
    ({'securityContext': {'seccompProfile': {'type': 'Unconfined'}}}, 'must not be Unconfined'),
    ({'securityContext': {'sysctls': [{'name': 'kernel.msgmax', 'value': '1'}]}}, 'not in the safe set'),
    ({'containerSecurityContext': {'allowPrivilegeEscalation': True}}, 'allowPrivilegeEscalation must be false'),
    ({'containerSecurityContext': {'privileged': True}}, 'privileged must be unset or false'),
    ({'containerSecurityContext': {'capabilities': {'add': ['SYS_ADMIN'], 'drop': ['ALL']}}},
     'capabilities.add beyond the baseline set'),
    ({'containerSecurityContext': {'capabilities': {'drop': ['NET_RAW']}}}, 'capabilities.drop must include ALL'),
    ({'containerSecurityContext': {'seLinuxOptions': {'user': 'root'}}}, 'user and role must be unset'),
    ({'containerSecurityContext': {'procMount': 'Unmasked'}}, 'procMount'),
    ({'volumes': [{'name': 'h', 'hostPath': {'path': '/data'}}]}, 'hostPath volumes are forbidden'),
    ({'volumes': [{'name': 'n', 'nfs': {'server': 's', 'path': '/m'}}]}, "type ['nfs'] is not allowed"),
])
def test_the_check_fails_what_restricted_forbids(template, broken):
    """Overrides reach the pod as written (the user's choice), and the check names the rule they break."""
    found = violations(build_pod(stage(podTemplate=template), 0))
    assert any(broken in v for v in found), found


@pytest.mark.parametrize('mutate, broken', [
    (lambda s: s.update(hostNetwork=True), 'hostNetwork'),
    (lambda s: s['containers'][0]['ports'].append({'containerPort': 80, 'hostPort': 80}), 'hostPort'),
    (lambda s: s['containers'][0]['securityContext'].pop('allowPrivilegeEscalation'), 'allowPrivilegeEscalation'),
    (lambda s: s['securityContext'].pop('seccompProfile'), 'seccompProfile.type must be'),
    (lambda s: s['securityContext'].pop('runAsNonRoot'), 'runAsNonRoot must be true'),
    (lambda s: s['initContainers'][0]['securityContext'].update(windowsOptions={'hostProcess': True}), 'hostProcess'),
    (lambda s: s['containers'][0]['securityContext'].update(appArmorProfile={'type': 'Unconfined'}), 'appArmor'),
])
def test_the_check_covers_fields_the_template_cannot_set(mutate, broken):
    pod = build_pod(stage(), 0)
    mutate(pod['spec'])
    assert any(broken in v for v in violations(pod)), violations(pod)


def test_a_host_path_model_cache_is_named_by_the_check():
    """model.cache.hostPath is a node folder: outside `restricted` (and baseline); the docs say so."""
    pod = build_pod(stage(model={'source': {'uri': URI}, 'cache': {'hostPath': '/var/cache/m', 'maxBytes': 1}}), 0)
    assert violations(pod) == ['volume model-cache: hostPath volumes are forbidden',
                               "volume model-cache: type ['hostPath'] is not allowed"]
