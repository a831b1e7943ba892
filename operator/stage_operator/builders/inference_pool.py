"""The stage's InferencePool (inference.networking.k8s.io/v1, the Gateway API Inference Extension), pure: the pods
an inference gateway's endpoint picker may route to. Its selector is the Service's (`serving_selector`: the stage's
pods labelled diffstage.io/serving=true), and the picker, like the Service's endpoints, takes only the ready pods
that are not being deleted: a fenced (draining, failed) or unready pod leaves the pool as it leaves the Service.
Owned by the stage: garbage collection deletes it with the stage."""

from __future__ import annotations

from typing import Any

from stage_operator.api.meta import HTTP_PORT, serving_selector
from stage_operator.builders.children import owned_metadata
from stage_operator.stage import Stage

POOL_API_VERSION = "inference.networking.k8s.io/v1"


def inference_pool_name(stage: Stage) -> str:
    return stage.name


def build_inference_pool(stage: Stage) -> dict[str, Any]:
    assert stage.spec is not None and stage.spec.routing is not None and stage.spec.routing.inference_pool, \
        "build the pool only when spec.routing.inferencePool is set"
    picker = stage.spec.routing.inference_pool.endpoint_picker
    return {"apiVersion": POOL_API_VERSION, "kind": "InferencePool",
            "metadata": owned_metadata(stage, inference_pool_name(stage)),
            "spec": {"selector": {"matchLabels": serving_selector(stage.name)},
                     "targetPorts": [{"number": HTTP_PORT}], "appProtocol": "http",
                     "endpointPickerRef": {"group": "", "kind": "Service", "name": picker.name,
                                           "port": {"number": picker.port}, "failureMode": picker.failure_mode}}}
