"""kube.observe reads what the job store names: the claim, or the object store's credentials Secret — of the Secret
only whether it exists (its metadata: the operator holds no credentials); where it may not read Secrets (403) it
does not hold the stage back. The API server is a table of answers by path."""
from __future__ import annotations

from typing import Any

import pytest
from support.reconcile_world import CPU, stage

from stage_operator.kube import ApiError, Kube

SECRET_PATH = '/api/v1/namespaces/ns/secrets/jobs-s3'
CLAIM_PATH = '/api/v1/namespaces/ns/persistentvolumeclaims/video-jobs'
SECRET = {'apiVersion': 'v1', 'kind': 'Secret', 'metadata': {'name': 'jobs-s3', 'namespace': 'ns'},
          'data': {'AWS_ACCESS_KEY_ID': 'QUtJQQ==', 'AWS_SECRET_ACCESS_KEY': 'c2VjcmV0'}}


class TableKube(Kube):
    """Kube with `request` answered from ``answers`` (path → object, None for 404, or an exception to raise)."""

    def __init__(self, answers: dict[str, Any]):
        super().__init__(client=object())
        self.answers, self.paths = answers, []

    def request(self, method: str, path: str, body: Any = None, query: Any = None, content_type: str = '') -> Any:
        self.paths.append(path)
        answer = self.answers.get(path, {'items': []} if path.endswith('/pods') else None)
        if isinstance(answer, Exception):
            raise answer
        return answer


def observe(jobs: dict, answers: dict[str, Any]) -> tuple[Any, list[str]]:
    kube = TableKube(answers)
    observed = kube.observe(stage({**CPU, 'jobs': jobs}), nodes=None, now='2026-01-01T00:00:00Z')
    return observed.jobs_claim, kube.paths


OBJECTS = {'objectStore': {'bucket': 'video-jobs', 'credentialsSecret': 'jobs-s3'}}


def test_an_existing_credentials_secret_is_observed_by_its_metadata_only():
    claim, paths = observe(OBJECTS, {SECRET_PATH: SECRET})
    assert SECRET_PATH in paths and CLAIM_PATH not in paths
    assert claim == {'metadata': SECRET['metadata']}, 'no key of the Secret is kept'


def test_a_missing_credentials_secret_is_observed_as_none():
    claim, paths = observe(OBJECTS, {})
    assert SECRET_PATH in paths and claim is None


def test_no_get_on_secrets_there_does_not_hold_the_stage_back():
    claim, _ = observe(OBJECTS, {SECRET_PATH: ApiError('GET', SECRET_PATH, 403, '{"message": "forbidden"}')})
    assert claim == {'metadata': {'name': 'jobs-s3', 'namespace': 'ns'}}


def test_any_other_failure_reading_the_secret_is_raised():
    with pytest.raises(ApiError, match='500'):
        observe(OBJECTS, {SECRET_PATH: ApiError('GET', SECRET_PATH, 500, 'boom')})


@pytest.mark.parametrize('jobs, read', [({'objectStore': {'bucket': 'video-jobs'}}, None),
                                        ({'claimName': 'video-jobs'}, CLAIM_PATH)],
                         ids=['service-account-identity', 'claim'])
def test_no_secret_is_read_without_a_credentials_secret(jobs, read):
    _, paths = observe(jobs, {})
    assert not any('/secrets/' in p for p in paths)
    assert (read in paths) if read else not any('persistentvolumeclaims' in p for p in paths)
