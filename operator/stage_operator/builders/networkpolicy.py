"""The stage's NetworkPolicy (pure): ingress to the stage's pods, per port.

    http (8000)  from `spec.networkPolicy.httpFrom` (default: every pod in the stage's namespace), the operator
                 (it probes /health and /v1/stats and posts /v1/abort) and, with
                 `spec.routing.inferencePool.gatewayNamespace`, every pod of the inference gateway's namespace
    zmq  (5570)  from the stage's own pods and the operator only: the ZMQ surface is cluster-internal

Egress is not restricted. The kubelet's probes come from the node and are not subject to it on the common CNIs.
"""

from __future__ import annotations

from typing import Any

from stage_operator.api.meta import (HTTP_PORT, OPERATOR_NAMESPACE, OPERATOR_POD_LABELS, ZMQ_PORT,
                                     stage_selector)
from stage_operator.builders.children import owned_metadata
from stage_operator.stage import Stage

SAME_NAMESPACE: list[dict[str, Any]] = [{"podSelector": {}}]


def network_policy_name(stage: Stage) -> str:
    return stage.name


def operator_peer() -> dict[str, Any]:
    return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": OPERATOR_NAMESPACE}},
            "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)}}


def namespace_peer(namespace: str) -> dict[str, Any]:
    return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}}


def _gateway(stage: Stage) -> list[dict[str, Any]]:
    """The inference gateway's proxies (another namespace, usually) reach the pods the endpoint picker chose."""
    routing = stage.spec.routing
    pool = routing.inference_pool if routing is not None else None
    return [namespace_peer(pool.gateway_namespace)] if pool is not None and pool.gateway_namespace else []


def build_network_policy(stage: Stage) -> dict[str, Any]:
    assert stage.spec is not None, "build children only for a valid spec"
    http_from = stage.spec.network_policy.http_from
    own = {"podSelector": {"matchLabels": stage_selector(stage.name)}}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": owned_metadata(stage, network_policy_name(stage)),
            "spec": {"podSelector": {"matchLabels": stage_selector(stage.name)}, "policyTypes": ["Ingress"],
                     "ingress": [
                         {"ports": [{"port": HTTP_PORT, "protocol": "TCP"}],
                          "from": [*(SAME_NAMESPACE if http_from is None else http_from), *_gateway(stage),
                                   operator_peer()]},
                         {"ports": [{"port": ZMQ_PORT, "protocol": "TCP"}], "from": [own, operator_peer()]}]}}
