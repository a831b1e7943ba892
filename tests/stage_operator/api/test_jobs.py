"""spec.jobs: the CRD admits what the runtime's JobsConfig accepts and refuses the rest, naming the field."""
from __future__ import annotations

import copy

import pytest
from pydantic import ValidationError
from support.crd_check import admit, apply_defaults, version_schema

from stage_operator import crdgen
from stage_operator.api.jobs import Jobs
from stage_operator.api.spec import StageSpec
from stage_runtime.config import JobsConfig

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
