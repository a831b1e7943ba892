"""`spec.podTemplate`, `spec.networkPolicy` and `spec.auth`: what reaches the stage's pods besides what the
operator builds (docs/crd.md). Kubernetes-native shapes pass through as given: the CRD keeps their unknown
fields and the API server checks them when the operator creates the pod (a refusal shows in the operator's
log as `reconcile failed`, retried with backoff).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field, model_validator

from stage_operator.api.base import ApiModel, cel

_CAMEL = ApiModel.model_config

KubeObject = dict[str, Any]  # a Kubernetes-native shape (toleration, volume, ...): validated by the API server


def _native(kind: str, into: str = "the pod") -> Any:
    """One Kubernetes-native object of a list, with the description `kubectl explain` shows for it."""
    return Annotated[KubeObject, Field(description=f"A {kind}, copied into {into} as given.")]


Toleration = _native("core/v1 Toleration")
EnvVar = _native("core/v1 EnvVar")
Volume = _native("core/v1 Volume")
VolumeMount = _native("core/v1 VolumeMount")
TopologySpreadConstraint = _native("core/v1 TopologySpreadConstraint")
PodResourceClaim = _native("core/v1 PodResourceClaim (name, and resourceClaimName or resourceClaimTemplateName)")
NetworkPolicyPeer = _native("networking.k8s.io/v1 NetworkPolicyPeer (podSelector, namespaceSelector or ipBlock)",
                            "the NetworkPolicy")


class LocalObjectReference(ApiModel):
    """A Secret of the stage's namespace, by name."""

    name: str = Field(min_length=1, description="The Secret's name (of type kubernetes.io/dockerconfigjson).")


OWNED_LABELS = "diffstage.io/"  # the operator's label and annotation prefix (stage, replica, serving, hash, draining)
MAX_POD_METADATA = 128
_OWNED_LABEL = f"k.startsWith('{OWNED_LABELS}') || k == 'app.kubernetes.io/managed-by'"


class PodTemplate(ApiModel):
    """What reaches every stage pod besides what the operator builds. The operator's own fields cannot be
    overridden: its labels and annotations (`diffstage.io/*`, `app.kubernetes.io/managed-by`: CEL refuses
    them), the stage container's command, probes, ports and GPU limits, the restart policy. `securityContext`
    and `containerSecurityContext` are merged key by key over the restricted defaults (docs/crd.md);
    every `resourceClaims` entry is also claimed by the stage container (`resources.claims`). Any change
    here rolls the pods."""

    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": [
        cel(f"!has(self.labels) || !self.labels.exists(k, {_OWNED_LABEL})",
            "'podTemplate.labels: diffstage.io/* and app.kubernetes.io/managed-by are labels of the operator "
            "(it selects and fences pods by them) and cannot be set'"),
        cel(f"!has(self.annotations) || !self.annotations.exists(k, k.startsWith('{OWNED_LABELS}'))",
            "'podTemplate.annotations: diffstage.io/* are annotations of the operator and cannot be set'"),
    ]})
    node_selector: dict[str, Annotated[str, Field(description="The value the node's label must have.")]] | None = \
        Field(None, description="Node labels the pods' node must carry, e.g. nvidia.com/gpu.present: \"true\".")
    tolerations: list[Toleration] | None = Field(None, description=(
        "Tolerations of the pods, e.g. of the taint on GPU nodes (key nvidia.com/gpu, operator Exists)."))
    affinity: KubeObject | None = Field(None, description=(
        "The pods' core/v1 Affinity (node affinity, pod affinity and anti-affinity), copied as given."))
    env: list[EnvVar] | None = Field(None, description=(
        "Environment variables of the stage container, after the operator's own (HF_HUB_OFFLINE, "
        "DIFFSTAGE_STAGE, DIFFSTAGE_REPLICA; with spec.jobs.objectStore.credentialsSecret also AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN). Set AWS_* here only for what the Secret does not hold (e.g. "
        "AWS_CA_BUNDLE)."))
    volumes: list[Volume] | None = Field(None, description=(
        "Volumes added to the pod, e.g. the claim holding a `model.path`; mount them with volumeMounts. A name "
        "the operator already uses (stage-config, dshm, stage-tmp, model, model-source, model-image, model-cache, "
        "builtin-models, api-keys) makes the pod invalid."))
    volume_mounts: list[VolumeMount] | None = Field(None, description=(
        "Mounts added to the stage container (not the init containers), after the operator's own."))
    service_account_name: str | None = Field(None, description=(
        "The pods' ServiceAccount; default: the namespace's `default`. With spec.jobs.objectStore and no "
        "credentialsSecret, its AWS identity (IRSA, EKS Pod Identity) reaches the bucket."))
    priority_class_name: str | None = Field(None, description=(
        "The pods' PriorityClass: their scheduling priority, and whether they may preempt others."))
    image_pull_secrets: list[LocalObjectReference] | None = Field(None, description=(
        "Secrets for pulling `image` and `model.source.image` from private registries."))
    # maxProperties bounds the CEL cost estimate of the owned-key rules (the API server refuses unbounded ones)
    labels: dict[str, str] | None = Field(None, max_length=MAX_POD_METADATA, description=(
        "Labels added to every pod (at most 128), e.g. Kueue's kueue.x-k8s.io/queue-name; diffstage.io/* and "
        "app.kubernetes.io/managed-by are the operator's and refused."))
    annotations: dict[str, str] | None = Field(None, max_length=MAX_POD_METADATA, description=(
        "Annotations added to every pod (at most 128); diffstage.io/* are the operator's and refused."))
    topology_spread_constraints: list[TopologySpreadConstraint] | None = Field(None, description=(
        "How to spread the replicas over zones or nodes; select the stage's pods with the label "
        "diffstage.io/stage: <stage name>."))
    scheduler_name: str | None = Field(None, min_length=1, description=(
        "The scheduler that places the pods (e.g. volcano); default: the cluster's default scheduler."))
    runtime_class_name: str | None = Field(None, min_length=1, description=(
        "The pods' RuntimeClass, e.g. nvidia where the NVIDIA container runtime is not the node's default."))
    resource_claims: list[PodResourceClaim] | None = Field(None, description=(
        "The pods' resourceClaims (Dynamic Resource Allocation); the stage container claims each of them."))
    security_context: KubeObject | None = Field(None, description=(
        "The pod's core/v1 PodSecurityContext, merged key by key over the restricted defaults (runAsNonRoot, "
        "runAsUser, runAsGroup and fsGroup 65532, seccomp RuntimeDefault): a key set here replaces the default's."))
    container_security_context: KubeObject | None = Field(None, description=(
        "The core/v1 SecurityContext of every container the operator builds (the stage and its init "
        "containers), merged key by key over the restricted defaults (allowPrivilegeEscalation false, "
        "capabilities drop ALL, readOnlyRootFilesystem true): a key set here replaces the default's."))

    @model_validator(mode="after")
    def _not_owned(self) -> PodTemplate:
        owned = [k for k in self.labels or {} if k.startswith(OWNED_LABELS) or k == "app.kubernetes.io/managed-by"]
        owned += [k for k in self.annotations or {} if k.startswith(OWNED_LABELS)]
        if owned:
            raise ValueError(f"podTemplate: {', '.join(owned)} belong to the operator and cannot be set")
        return self


class NetworkPolicy(ApiModel):
    """The NetworkPolicy the operator owns per stage (`<stage>`, ingress only): the HTTP port from `httpFrom`
    and the operator; the ZMQ port only from the stage's own pods and the operator. Disabled: none is made
    (an existing one is deleted)."""

    enabled: bool = Field(True, description=(
        "true (default): the operator keeps the NetworkPolicy `<stage>`; false: it deletes it and makes none."))
    http_from: list[NetworkPolicyPeer] | None = Field(None, description=(
        "Who may reach the HTTP port (8000) besides the operator; default: every pod in the stage's namespace; "
        "[]: only the operator. Add your ingress controller's or Prometheus' namespace here."))


class SecretKeyRef(ApiModel):
    """A key of a Secret in the stage's namespace."""

    name: str = Field(min_length=1, description="The Secret's name, in the stage's namespace.")
    key: str = Field("api-keys", min_length=1, description=(
        "The key holding the API keys, one a line (default api-keys)."))


class Auth(ApiModel):
    """API keys for the stage's /v1/* routes (`--api-key-file`); /health, /ready and /metrics stay open.
    The operator mounts the Secret and reads it (RBAC `get` on secrets in the namespace) for its own
    /v1/stats and /v1/abort calls, with the first key in it."""

    secret_ref: SecretKeyRef = Field(description=(
        "The Secret holding the keys, mounted read-only in the pods at /etc/diffstage-auth. The operator reads "
        "it too, which needs a RoleBinding to the ClusterRole diffstage-operator-stage-auth in this namespace; "
        "without it the pods still serve, but the operator's probe measures no load and its aborts are refused."))
