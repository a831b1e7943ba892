"""spec.jobs: the CRD admits what the runtime's JobsConfig accepts and refuses the rest, naming the field."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from support.crd_check import admit, apply_defaults, version_schema

from stage_operator import crdgen
from stage_operator.api.jobs import Jobs
from stage_operator.api.spec import StageSpec
from stage_operator.builders.children import build_configmap
from stage_operator.builders.pod import build_pod
from stage_operator.stage import parse_stage
from stage_runtime.config import JobsConfig, load_config

ROOT = Path(__file__).resolve().parents[3]

CRD = crdgen.build_crd()
BASE = {'apiVersion': 'diffstage.io/v1alpha1', 'kind': 'DiffusionStage', 'metadata': {'name': 's'},
        'spec': {'model': {'builtin': 'tiny-sd'}}}


def with_jobs(jobs: dict) -> dict:
    obj = copy.deepcopy(BASE)
    obj['spec']['jobs'] = jobs
    return obj


def test_defaults_are_the_runtimes():
    spec = apply_defaults(version_schema(CRD), with_jobs({'claimName': 'video-jobs'}))['spec']
    runtime = JobsConfig()
    assert spec['jobs'] == {'claimName': 'video-jobs', 'checkpointEverySteps': runtime.checkpoint_every_steps,
                            'retentionSeconds': runtime.retention_s, 'leaseSeconds': runtime.lease_s}
    assert StageSpec.model_validate(spec).jobs == Jobs(claim_name='video-jobs')
    assert 'jobs' not in apply_defaults(version_schema(CRD), copy.deepcopy(BASE))['spec'], 'off unless asked'


@pytest.mark.parametrize('field, low, high', [('checkpointEverySteps', 0, 10_000), ('retentionSeconds', 1, 365 * 86400),
                                              ('leaseSeconds', 1, 3600)])
def test_bounds_are_admitted_at_the_edges_and_refused_past_them_by_the_crd_and_the_model(field, low, high):
    for value in (low, high):
        obj = with_jobs({'claimName': 'j', field: value})
        assert admit(CRD, obj) == []
        jobs = StageSpec.model_validate(obj['spec']).jobs
        JobsConfig(store='/x', checkpoint_every_steps=jobs.checkpoint_every_steps,  # the runtime takes it too
                   retention_s=jobs.retention_seconds, lease_s=jobs.lease_seconds)
    for value in (low - 1, high + 1):
        obj = with_jobs({'claimName': 'j', field: value})
        assert any(field in m for m in admit(CRD, obj)), (field, value)
        with pytest.raises(ValidationError, match=field):
            StageSpec.model_validate(obj['spec'])


@pytest.mark.parametrize('jobs', [{}, {'claimName': ''}, {'claimName': 'Video_Jobs'},
                                  {'claimName': 'j', 'bucket': 'b'}],
                         ids=['missing', 'empty', 'not-a-dns-name', 'unknown-field'])
def test_a_bad_claim_is_refused_naming_the_field(jobs):
    obj = with_jobs(jobs)
    if 'bucket' not in jobs:  # an unknown field the API server prunes; the operator's model refuses it
        assert any('claimName' in m for m in admit(CRD, obj)), admit(CRD, obj)
    with pytest.raises(ValidationError) as err:
        StageSpec.model_validate(obj['spec'])
    assert 'jobs' in str(err.value) and ('claimName' in str(err.value) or 'bucket' in str(err.value))


def test_every_jobs_field_is_described_for_kubectl_explain():
    schema = version_schema(CRD)['properties']['spec']['properties']['jobs']
    assert schema['description'] and 'required' not in schema          # claimName or objectStore (a CEL rule)
    assert all(prop.get('description') for prop in schema['properties'].values())
    bucket = schema['properties']['objectStore']
    assert bucket['required'] == ['bucket'] and all(p.get('description') for p in bucket['properties'].values())


@pytest.mark.parametrize('jobs', [
    {'objectStore': {'bucket': 'video-jobs'}},
    {'objectStore': {'bucket': 'video.jobs-2', 'prefix': 'stages/a', 'endpoint': 'http://minio.storage:9000',
                     'region': 'eu-west-1', 'credentialsSecret': 'jobs-s3'}, 'presignedContent': True},
])
def test_an_object_store_is_admitted_and_becomes_the_runtimes_s3_store(jobs):
    obj = with_jobs(jobs)
    assert admit(CRD, obj) == []
    parsed = StageSpec.model_validate(obj['spec']).jobs
    bucket = parsed.object_store
    config = JobsConfig(store=bucket.url, endpoint=bucket.endpoint, region=bucket.region,
                        presigned_content=bool(parsed.presigned_content))      # the runtime takes it too
    assert config.store.startswith(f"s3://{jobs['objectStore']['bucket']}/")


@pytest.mark.parametrize('jobs, named', [
    ({'claimName': 'j', 'objectStore': {'bucket': 'video-jobs'}}, 'set exactly one of claimName or objectStore'),
    ({'objectStore': {'bucket': 'Video_Jobs'}}, 'bucket'),
    ({'objectStore': {'bucket': 'ab'}}, 'bucket'),
    ({'objectStore': {'bucket': 'video-jobs', 'prefix': '/root'}}, 'prefix'),
    ({'objectStore': {'bucket': 'video-jobs', 'endpoint': 'minio:9000'}}, 'endpoint'),
    ({'objectStore': {'bucket': 'video-jobs', 'credentialsSecret': 'Not A Name'}}, 'credentialsSecret'),
    ({'claimName': 'j', 'presignedContent': True}, 'presignedContent needs jobs.objectStore'),
], ids=['both', 'bucket-case', 'bucket-short', 'prefix-slash', 'endpoint-scheme', 'secret-name', 'presign-claim'])
def test_a_bad_object_store_is_refused_by_the_crd_and_the_model_naming_the_field(jobs, named):
    obj = with_jobs(jobs)
    assert any(named in m for m in admit(CRD, obj)), admit(CRD, obj)
    with pytest.raises(ValidationError, match=named):
        StageSpec.model_validate(obj['spec'])


def runtime_takes(**jobs) -> bool:
    try:
        JobsConfig(**jobs)
    except ValidationError:
        return False
    return True


@pytest.mark.parametrize('bucket', ['abc', 'a' * 63, 'video.jobs-2', '0video', 'ab', 'a' * 64, 'Video', '-abc', 'abc-',
                                    'a_b', 'abc.', 'a b'])
def test_the_crd_admits_a_bucket_exactly_when_the_runtime_takes_it(bucket):
    crd = admit(CRD, with_jobs({'objectStore': {'bucket': bucket}})) == []
    assert crd == runtime_takes(store=f's3://{bucket}/p'), bucket


@pytest.mark.parametrize('endpoint', ['http://minio:9000', 'https://s3.eu-west-1.example.com', 'http://10.0.0.1:9000/s3',
                                      'minio:9000', 'ftp://minio', 'http://', 'http:// minio', 'https:///x'])
def test_the_crd_admits_an_endpoint_exactly_when_the_runtime_takes_it(endpoint):
    crd = admit(CRD, with_jobs({'objectStore': {'bucket': 'video-jobs', 'endpoint': endpoint}})) == []
    assert crd == runtime_takes(store='s3://video-jobs/p', endpoint=endpoint), endpoint


@pytest.mark.parametrize('prefix', ['', 'a', 'stages/a', 'stages/a/', 'a.b-c_d/é'])
def test_every_prefix_the_crd_admits_is_a_store_the_runtime_takes(prefix):
    obj = with_jobs({'objectStore': {'bucket': 'video-jobs', 'prefix': prefix}})
    assert admit(CRD, obj) == []
    assert runtime_takes(store=StageSpec.model_validate(obj['spec']).jobs.object_store.url)


@pytest.mark.parametrize('jobs, field, value', [
    ({'objectStore': {'bucket': 'Video_Jobs'}}, 'spec.jobs.objectStore.bucket', "'Video_Jobs'"),
    ({'objectStore': {'bucket': 'video-jobs', 'prefix': '/root'}}, 'spec.jobs.objectStore.prefix', "'/root'"),
    ({'objectStore': {'bucket': 'video-jobs', 'endpoint': 'minio:9000'}}, 'spec.jobs.objectStore.endpoint',
     "'minio:9000'"),
])
def test_the_operators_invalid_spec_message_names_the_field_and_its_value(jobs, field, value):
    st = parse_stage({'metadata': {'name': 's', 'namespace': 'ns', 'uid': 'u', 'generation': 1},
                      'spec': with_jobs(jobs)['spec']})
    assert st.spec is None and f'{field}={value}' in st.error, st.error
    assert any(field.removeprefix('spec.').split('.')[-1] in m and value.strip("'") in m for m in admit(CRD, with_jobs(jobs)))


def test_the_object_store_sample_runs_on_its_bucket_and_scales_on_its_jobs():
    obj = yaml.safe_load((ROOT / 'manifests/samples/tiny-wan-object-store.yaml').read_text())
    assert admit(CRD, obj) == []
    st = parse_stage({**obj, 'metadata': {**obj['metadata'], 'namespace': 'ns', 'uid': 'u', 'generation': 1}})
    assert st.spec is not None, st.error
    config = load_config(yaml.safe_load(build_configmap(st)['data']['stage.yaml']))
    assert (config.jobs.store, config.jobs.endpoint) == ('s3://video-jobs/stages/tiny-wan-jobs',
                                                         'http://minio.storage.svc:9000')
    env = {e['name']: e.get('valueFrom') for e in build_pod(st, 0)['spec']['containers'][0]['env']}
    assert env['AWS_ACCESS_KEY_ID'] == {'secretKeyRef': {'name': 'video-jobs-s3', 'key': 'AWS_ACCESS_KEY_ID'}}
    assert st.spec.autoscaling.metric == 'jobs', 'metric jobs on an object store'
