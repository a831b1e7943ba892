"""The stage's NetworkPolicy: HTTP from the namespace (or `httpFrom`) and the operator, ZMQ only from the stage's
own pods and the operator; owned by the stage; valid against the Kubernetes schemas."""
from __future__ import annotations

import copy

import pytest

from stage_operator.builders.networkpolicy import build_network_policy
from stage_operator.stage import parse_stage

OPERATOR = {'namespaceSelector': {'matchLabels': {'kubernetes.io/metadata.name': 'diffstage-system'}},
            'podSelector': {'matchLabels': {'app.kubernetes.io/name': 'diffstage-operator'}}}


def stage(**spec):
    body = {'metadata': {'name': 'tiny', 'namespace': 'team', 'uid': 'uid-9', 'generation': 1},
            'spec': {'model': {'builtin': 'tiny-sd'}, **copy.deepcopy(spec)}}
    st = parse_stage(body)
    assert st.spec is not None, st.error
    return st


def rules(policy):
    return {r['ports'][0]['port']: r['from'] for r in policy['spec']['ingress']}


def test_default_policy_http_from_the_namespace_zmq_from_the_stage_and_the_operator():
    policy = build_network_policy(stage())
    assert policy['metadata']['name'] == 'tiny' and policy['metadata']['namespace'] == 'team'
    assert policy['metadata']['ownerReferences'][0]['uid'] == 'uid-9', 'garbage-collected with the stage'
    assert policy['spec']['podSelector'] == {'matchLabels': {'diffstage.io/stage': 'tiny'}}
    assert policy['spec']['policyTypes'] == ['Ingress'], 'egress is not restricted'
    assert all(r['ports'][0]['protocol'] == 'TCP' for r in policy['spec']['ingress'])
    assert rules(policy) == {8000: [{'podSelector': {}}, OPERATOR],
                             5570: [{'podSelector': {'matchLabels': {'diffstage.io/stage': 'tiny'}}}, OPERATOR]}


@pytest.mark.parametrize('http_from', [
    [{'namespaceSelector': {'matchLabels': {'kubernetes.io/metadata.name': 'ingress-nginx'}}}],
    [{'ipBlock': {'cidr': '10.0.0.0/8'}}, {'podSelector': {'matchLabels': {'role': 'frontend'}}}],
    [],  # nobody but the operator
])
def test_http_from_is_configurable_and_zmq_is_not(http_from):
    policy = build_network_policy(stage(networkPolicy={'httpFrom': http_from}))
    assert rules(policy)[8000] == [*http_from, OPERATOR]
    assert rules(policy)[5570] == rules(build_network_policy(stage()))[5570]


@pytest.mark.parametrize('version', ['1.29', '1.37'])
@pytest.mark.parametrize('spec', [{}, {'networkPolicy': {'httpFrom': [{'ipBlock': {'cidr': '10.0.0.0/8'}}]}}])
def test_validates_against_the_kubernetes_schemas(version, spec):
    import kubernetes_validate

    kubernetes_validate.validate(build_network_policy(stage(**spec)), version, strict=True)
