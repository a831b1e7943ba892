"""spec.routing.inferencePool: the InferencePool the operator owns. Its selector is the Service's, so the endpoint
picker's membership rule (Ready, labels match, not terminating: support.endpoint_picker) leaves out a fenced
(draining) pod exactly as the Service's endpoints do; admitted by the published v1 schema (the local cluster's
copy); created with the stage's children, left alone when unchanged, deleted when the field goes, and owned by
the stage (garbage-collected with it). The NetworkPolicy admits the gateway's namespace."""
from __future__ import annotations

import copy

import yaml
from support.endpoint_picker import pool_members
from support.reconcile_world import CPU, apply_merge, pod, stage, world

from e2e.local import admission
from e2e.local.custom_resources import CLUSTER_CRDS
from stage_operator.builders.children import build_service
from stage_operator.builders.inference_pool import build_inference_pool
from stage_operator.builders.networkpolicy import build_network_policy
from stage_operator.reconcile import reconcile

ROUTED = {**CPU, 'routing': {'inferencePool': {'endpointPicker': {'name': 'diffstage-epp'},
                                               'gatewayNamespace': 'gateway-system'}}}
SCHEMA = yaml.safe_load((CLUSTER_CRDS / 'inferencepools.yaml').read_text())['spec']['versions'][0]['schema'][
    'openAPIV3Schema']


def test_the_pool_selects_what_the_service_selects_and_names_the_picker():
    st = stage(ROUTED)
    pool = build_inference_pool(st)
    assert pool['apiVersion'] == 'inference.networking.k8s.io/v1' and pool['kind'] == 'InferencePool'
    assert pool['metadata']['name'] == 's' and pool['metadata']['ownerReferences'][0]['uid'] == 'uid-1'
    assert pool['spec']['selector'] == {'matchLabels': build_service(st)['spec']['selector']}
    assert pool['spec']['targetPorts'] == [{'number': 8000}]
    assert pool['spec']['endpointPickerRef'] == {'group': '', 'kind': 'Service', 'name': 'diffstage-epp',
                                                 'port': {'number': 9002}, 'failureMode': 'FailClose'}


def test_the_pool_is_admitted_by_the_published_schema_and_needs_no_defaulting():
    pool = build_inference_pool(stage(ROUTED))
    defaulted = admission.default(SCHEMA, copy.deepcopy(pool))
    assert admission.validate(SCHEMA, defaulted) == [] and defaulted == pool     # what the API stores: as built
    broken = copy.deepcopy(pool)
    del broken['spec']['endpointPickerRef']['port']
    [error] = admission.validate(SCHEMA, broken)
    assert "port is required when kind is 'Service' or unspecified (defaults to 'Service')" in str(error)


def test_a_fenced_pod_leaves_the_pool_as_it_leaves_the_service():
    """A scale-down fences the victim (serving=false) while it still runs its requests: still Ready, not
    terminating, out of the Service's selector and so out of the pool."""
    st = stage({**ROUTED, 'replicas': 1}, status={'inferencePool': 's'})
    pods = [pod(st, 0), pod(st, 1)]
    pool = build_inference_pool(st)
    assert pool_members(pool, pods) == ['s-0', 's-1']
    plan = reconcile(st, world(st, pods))
    fence = next(p for p in plan.patch if p.kind == 'Pod')
    fenced = next(p for p in pods if p['metadata']['name'] == fence.name)
    apply_merge(fenced['metadata'], fence.body['metadata'])
    assert fenced['metadata']['labels']['diffstage.io/serving'] == 'false' and not fenced['metadata'].get(
        'deletionTimestamp')
    assert pool_members(pool, pods) == [n for n in ['s-0', 's-1'] if n != fence.name]
    terminating, unready = pod(st, 0, 'terminating'), pod(st, 1, 'starting')
    assert pool_members(pool, [terminating, unready]) == []


def test_created_with_the_children_kept_when_unchanged_and_deleted_when_the_field_goes():
    st = stage(ROUTED)
    created = [o for o in reconcile(st, world(st)).create if o['kind'] == 'InferencePool']
    assert created == [build_inference_pool(st)]
    observed = world(st, [pod(st, 0), pod(st, 1)])
    observed = type(observed)(**{**observed.__dict__, 'inference_pool': build_inference_pool(st)})
    plan = reconcile(st, observed)
    assert not [p for p in plan.patch if p.kind == 'InferencePool'] and plan.status['inferencePool'] == 's'
    gone = stage(CPU, status={'inferencePool': 's'})
    plan = reconcile(gone, world(gone))
    assert [(d.kind, d.name, d.reason) for d in plan.delete] == [('InferencePool', 's', 'RoutingRemoved')]
    assert plan.status['inferencePool'] is None                                 # the record goes with it
    assert not [d for d in reconcile(stage(CPU), world(stage(CPU))).delete if d.kind == 'InferencePool']


def test_the_network_policy_admits_the_gateways_namespace_on_the_http_port_only():
    policy = build_network_policy(stage(ROUTED))
    http, zmq = (r['from'] for r in policy['spec']['ingress'])
    gateway = {'namespaceSelector': {'matchLabels': {'kubernetes.io/metadata.name': 'gateway-system'}}}
    assert gateway in http and gateway not in zmq and {'podSelector': {}} in http
    assert gateway not in build_network_policy(stage(CPU))['spec']['ingress'][0]['from']
