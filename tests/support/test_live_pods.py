"""The stand-in stage (support.live_pods.StandIn) says only what a real stage may say: every route it serves is
in the real stage's own `GET /openapi.json`, and every answer it gives (alive and dead) fits the schema that
document gives for that path, method, status code and content type. The document is OpenAPI 3.1: its schemas
are JSON Schema 2020-12, their `$ref`s resolved within the document."""
from __future__ import annotations

import httpx
import pytest
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012
from support.live_pods import StandIn, live_stages

DOC = 'urn:diffstage:stage-openapi'  # where the document sits in the registry: its `$ref`s resolve inside it


@pytest.fixture(scope='module')
def stage(tiny_sd_path, tmp_path_factory):
    with live_stages(tiny_sd_path, tmp_path_factory.mktemp('openapi-stage'), 1) as (live,):
        yield live


@pytest.fixture(scope='module')
def document(stage):
    answer = httpx.get(f'{stage.http_url}/openapi.json', timeout=10)
    assert answer.status_code == 200
    return answer.json()


def pointer(*parts: str) -> str:
    return '/'.join(['#', *(p.replace('~', '~0').replace('/', '~1') for p in parts)])


def check_answer(document: dict, method: str, path: str, answer: httpx.Response) -> None:
    """`answer` to `method path` is one the document declares, and its body fits the declared schema."""
    operation = document['paths'].get(path, {}).get(method.lower())
    assert operation, f'{method} {path} is not in the stage document (its paths: {sorted(document["paths"])})'
    status = str(answer.status_code)
    assert status in operation['responses'], f'{method} {path} answered {status}: the stage declares ' \
        f'{sorted(operation["responses"])}'
    media = answer.headers['content-type'].split(';')[0]
    content = operation['responses'][status].get('content', {})
    assert media in content, f'{method} {path} {status} answered {media}: the stage declares {sorted(content)}'
    registry = Registry().with_resource(DOC, Resource.from_contents(document, default_specification=DRAFT202012))
    schema = {'$ref': DOC + pointer('paths', path, method.lower(), 'responses', status, 'content', media, 'schema')}
    Draft202012Validator(schema, registry=registry).validate(answer.json())


def test_the_stand_in_answers_only_what_the_stage_document_allows(document):
    seen = set()
    for dead in (None, 'worker rank 0 stopped answering (collective timed out)'):
        with StandIn(dead=dead) as stand_in:
            served = {(r.method, r.resource.canonical) for r in stand_in.app.router.routes() if r.method != 'HEAD'}
            assert served, 'the stand-in serves nothing'
            for method, path in sorted(served):
                answer = httpx.request(method, f'{stand_in.url}{path}', timeout=5)
                check_answer(document, method, path, answer)
                seen.add((method, path, answer.status_code))
    assert {('GET', '/health', 200), ('GET', '/health', 503), ('GET', '/v1/stats', 200)} <= seen, seen


def test_the_real_stage_answers_what_its_document_says(stage, document):
    """The same check on the stage itself: what it documents is what it says (so a stand-in that fits the
    document fits the stage)."""
    for path in ('/health', '/v1/stats'):
        check_answer(document, 'GET', path, httpx.get(f'{stage.http_url}{path}', timeout=5))
