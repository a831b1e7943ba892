"""The stage's ConfigMap and Service: pure functions of the Stage."""

from __future__ import annotations

from typing import Any

import yaml

from stage_operator.api.meta import (CONFIG_FILE, HTTP_PORT, LABEL_MANAGED_BY, LABEL_STAGE, MANAGED_BY, ZMQ_PORT,
                                     serving_selector)
from stage_operator.builders.runtime_config import stage_config
from stage_operator.stage import Stage


def stage_labels(stage: Stage) -> dict[str, str]:
    return {LABEL_STAGE: stage.name, LABEL_MANAGED_BY: MANAGED_BY}


def owned_metadata(stage: Stage, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"name": name, "namespace": stage.namespace, "labels": labels or stage_labels(stage),
            "ownerReferences": [stage.owner_reference()]}


def configmap_name(stage: Stage) -> str:
    return f"{stage.name}-config"


def build_configmap(stage: Stage, loras: Any = None) -> dict[str, Any]:
    """The stage.yaml every pod mounts; ``loras``: the startup adapters when not the spec's (lora_sync's applied
    list; ``()``: none, as the template hash sees it: the list changes live, never by a roll)."""
    assert stage.spec is not None, "build children only for a valid spec"
    text = yaml.safe_dump(stage_config(stage.spec, stage.name, loras), sort_keys=True)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": owned_metadata(stage, configmap_name(stage)),
            "data": {CONFIG_FILE: text}}


def build_service(stage: Stage) -> dict[str, Any]:
    """Selects the stage's serving pods; Kubernetes adds only the ready ones to its endpoints."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": owned_metadata(stage, stage.name),
            "spec": {"type": "ClusterIP", "selector": serving_selector(stage.name),
                     "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
                               {"name": "zmq", "port": ZMQ_PORT, "targetPort": "zmq", "protocol": "TCP"}]}}
