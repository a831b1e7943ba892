"""`spec.routing`: how traffic reaches the stage besides its Service. `inferencePool` makes the operator own an
InferencePool (inference.networking.k8s.io/v1, the Gateway API Inference Extension) over the serving selector,
so a gateway's endpoint picker routes to the stage's serving, ready replicas (docs/operator.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from stage_operator.api.base import ApiModel

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
EPP_PORT = 9002  # the endpoint picker's gRPC ext_proc port, as the inference extension's charts set it


class EndpointPicker(ApiModel):
    """The endpoint picker (EPP) the gateway asks which replica serves a request: a Service in the stage's
    namespace, becoming the pool's `endpointPickerRef`."""

    name: str = Field(min_length=1, max_length=253, description=(
        "The endpoint picker's Service, in the stage's namespace."))
    port: int = Field(EPP_PORT, ge=1, le=65535, description=(
        f"The Service port of its ext_proc gRPC endpoint (default {EPP_PORT})."))
    failure_mode: Literal["FailOpen", "FailClose"] = Field("FailClose", description=(
        "What the gateway does when the picker does not answer: FailClose (default) refuses the request, "
        "FailOpen sends it to an endpoint of the gateway's choosing."))


class InferencePool(ApiModel):
    """An InferencePool `<stage>` owned by the stage (deleted with it): selector = the Service's (the stage's
    pods labelled diffstage.io/serving=true, so a fenced, draining or unready pod leaves the pool as it leaves
    the Service), target port 8000. The InferencePool CRD (inference.networking.k8s.io/v1) must be installed."""

    endpoint_picker: EndpointPicker
    gateway_namespace: str | None = Field(None, max_length=63, pattern=DNS_LABEL, description=(
        "The namespace of the gateway's proxy pods (e.g. Envoy), when not the stage's: the stage's NetworkPolicy "
        "admits it on the HTTP port 8000. Default: none added (the namespace's own pods are admitted by default)."))


class Routing(ApiModel):
    """Routing besides the stage's Service."""

    inference_pool: InferencePool | None = Field(None, description=(
        "Make the operator own an InferencePool `<stage>` over the serving replicas for a Gateway API inference "
        "gateway; removing it deletes the pool."))
