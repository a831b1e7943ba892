"""`DiffusionStage.spec` (docs/crd.md) as pydantic models; `crdgen` turns them into the CRD schema.

CEL rules live on the types they guard (`x-kubernetes-validations`). The parallel arithmetic in CEL is the
same rule `stage_runtime.config.ParallelConfig` enforces (world size = product of degrees = GPUs per pod);
`StageSpec.topology()` asks ParallelConfig itself, so the operator never re-implements it.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import annotated_types
from pydantic import ConfigDict, Field, model_validator

from stage_operator.api.base import ApiModel, cel
from stage_operator.api.meta import DEFAULT_GPU_RESOURCE, DEFAULT_IMAGE
from stage_operator.api.model import ModelSource
from stage_runtime.config import LORA_NAME_PATTERN, ConfigError, ParallelConfig

_CAMEL = ApiModel.model_config


def _bounds(field: str) -> dict[str, int]:
    """ge/le of a ParallelConfig field, so the CRD minimums and maximums come from the one source of truth."""
    out: dict[str, int] = {}
    for m in ParallelConfig.model_fields[field].metadata:
        if isinstance(m, annotated_types.Ge):
            out["ge"] = m.ge
        elif isinstance(m, annotated_types.Le):
            out["le"] = m.le
    return out


class Parallel(ApiModel):
    """Parallel degrees inside one pod's engine; their product is the world size (= resources.gpusPerPod)."""

    tensor_parallel_size: int = Field(1, **_bounds("tensor_parallel_size"))
    ulysses_degree: int = Field(1, **_bounds("ulysses_degree"))
    ring_degree: int = Field(1, **_bounds("ring_degree"))
    cfg_parallel_size: int = Field(1, **_bounds("cfg_parallel_size"))
    data_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, **_bounds("pipeline_parallel_size"))

    @property
    def product(self) -> int:
        return (self.tensor_parallel_size * self.ulysses_degree * self.ring_degree * self.cfg_parallel_size
                * self.data_parallel_size * self.pipeline_parallel_size)


class Resources(ApiModel):
    gpus_per_pod: int = Field(1, ge=1, description="ranks per pod: GPUs, or CPU processes when gpuResourceName is ''")
    gpu_resource_name: str = Field(DEFAULT_GPU_RESOURCE, description="extended resource; '' = CPU ranks")
    cpu: str | None = None
    memory: str | None = None
    shm_size: str | None = Field(None, description="size of the memory-backed /dev/shm")


class Engine(ApiModel):
    execution_mode: Literal["request", "step"] = "request"
    max_num_seqs: int = Field(1, ge=1, le=1024)
    request_batch_max_wait_ms: int = Field(0, ge=0)
    max_waiting: int | None = Field(None, ge=1)
    streaming: bool = False
    executor: Literal["uni", "mp"] | None = None
    device: Literal["auto", "cpu", "cuda"] | None = None
    extra_args: list[str] = Field(default_factory=list)


class LoraAdapter(ApiModel):
    """A LoRA adapter every replica loads at startup (docs/lora.md); requests name it in ``loras``."""

    name: str = Field(pattern=LORA_NAME_PATTERN, description="the name requests give in `loras`")
    path: str = Field(min_length=1, description="the adapter's safetensors file (or its folder) inside the pod: "
                                                "in the image or on a mounted volume")
    pinned: bool = Field(True, description="never evicted to make room under maxLoras")


class RestartPolicy(ApiModel):
    """Fail-closed restarts of a replica: backoff initial·2ⁿ capped; at most maxRestarts per window."""

    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": [cel(
        "self.backoffInitialSeconds <= self.backoffMaxSeconds",
        "'restartPolicy.backoffInitialSeconds (' + string(self.backoffInitialSeconds) + "
        "') must not exceed backoffMaxSeconds (' + string(self.backoffMaxSeconds) + ')'")]})
    max_restarts: int = Field(5, ge=0)
    window_seconds: int = Field(600, ge=1)
    backoff_initial_seconds: int = Field(10, ge=1)
    backoff_max_seconds: int = Field(300, ge=1)


class HealthCheck(ApiModel):
    """The operator's own probe of each serving pod (`/health` and `/v1/stats`): `/health` 503 fails at once;
    `failureThreshold` consecutive probes without an answer fail too. Seconds may be fractional."""

    period_seconds: float = Field(10.0, ge=0.1, le=3600)
    timeout_seconds: float = Field(2.0, ge=0.1, le=60)
    failure_threshold: int = Field(3, ge=1, le=100)


class Abort(ApiModel):
    """A nonce: each new `id` aborts `requestIds` (or `all`) on every serving pod; the result is in status."""

    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": [cel(
        "has(self.requestIds) != (has(self.all) && self.all)",
        "'abort: set exactly one of requestIds or all: true'")]})
    id: str = Field(min_length=1)
    request_ids: list[str] | None = None
    all: bool | None = None


_OPERATOR_ONLY = ("minReplicas", "maxReplicas", "targetInFlightPerReplica",
                  "scaleUpStabilizationSeconds", "scaleDownStabilizationSeconds")


SCALE_TO_ZERO = ("autoscaling.minReplicas 0 is refused with mode Operator: a stage at 0 has no pod to probe, so "
                 "nothing would scale it back up; use mode External with KEDA (its HTTP add-on holds requests "
                 "and scales 0 to 1 through /scale), or set minReplicas >= 1")


class Autoscaling(ApiModel):
    """Who owns `replicas`: None (you), External (HPA/KEDA through /scale), Operator (the operator)."""

    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": [
        cel("self.mode == 'Operator' || !(" + " || ".join(f"has(self.{f})" for f in _OPERATOR_ONLY) + ")",
            "'autoscaling.mode is ' + self.mode + ': " + ", ".join(_OPERATOR_ONLY)
            + " apply only with mode Operator'"),
        cel("self.mode != 'Operator' || has(self.maxReplicas)",
            "'autoscaling.mode Operator needs maxReplicas'"),
        cel("!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
            "'autoscaling.minReplicas (' + string(self.minReplicas) + ') must not exceed maxReplicas ('"
            " + string(self.maxReplicas) + ')'"),
        cel("self.mode != 'Operator' || !has(self.minReplicas) || self.minReplicas >= 1", f"'{SCALE_TO_ZERO}'"),
    ]})
    mode: Literal["None", "External", "Operator"] = "None"
    min_replicas: int | None = Field(None, ge=0)
    max_replicas: int | None = Field(None, ge=1)
    target_in_flight_per_replica: int | None = Field(None, ge=1)
    scale_up_stabilization_seconds: int | None = Field(None, ge=0)
    scale_down_stabilization_seconds: int | None = Field(None, ge=0)
    drain_timeout_seconds: int = Field(60, ge=0, description="how long a removed replica may finish its work")

    @model_validator(mode="after")
    def _wakes_up(self) -> Autoscaling:
        if self.mode == "Operator" and self.min_replicas == 0:
            raise ValueError(SCALE_TO_ZERO)
        return self


class Rollout(ApiModel):
    """How a pod-template change rolls out: up to `maxSurge` extra pods (GPUs permitting) and at most
    `maxUnavailable` replicas below `replicas`; a revision that makes no progress for
    `progressDeadlineSeconds` (or exits 2, or crash-loops) is rolled back to the last Ready one."""

    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": [cel(
        "self.maxSurge + self.maxUnavailable >= 1",
        "'rollout: maxSurge (' + string(self.maxSurge) + ') and maxUnavailable (' + string(self.maxUnavailable)"
        " + ') cannot both be 0: the rollout could never replace a pod'")]})
    max_surge: int = Field(0, ge=0, description="extra pods during a rollout (each needs gpusPerPod free GPUs)")
    max_unavailable: int = Field(1, ge=0, description="replicas that may be unavailable during a rollout")
    progress_deadline_seconds: int | None = Field(None, ge=1, description=(
        "seconds without a new replica becoming ready before the rollout is rolled back; "
        "default startupTimeoutSeconds + 60"))

    @model_validator(mode="after")
    def _can_progress(self) -> Rollout:
        if self.max_surge + self.max_unavailable < 1:
            raise ValueError(f"rollout: maxSurge ({self.max_surge}) and maxUnavailable ({self.max_unavailable}) "
                             "cannot both be 0: the rollout could never replace a pod")
        return self


class Disruption(ApiModel):
    """The stage's PodDisruptionBudget (voluntary disruptions: node drains, evictions)."""

    max_unavailable: int | None = Field(None, ge=0, description=(
        "replicas a voluntary disruption may take at once; default 1 when replicas >= 2, else no budget"))


class LocalObjectReference(ApiModel):
    name: str = Field(min_length=1)


KubeObject = dict[str, Any]  # a Kubernetes-native shape (toleration, volume, ...): validated by the API server


OWNED_LABELS = "diffstage.io/"  # the operator's label and annotation prefix (stage, replica, serving, hash, draining)
MAX_POD_METADATA = 128
_OWNED_LABEL = f"k.startsWith('{OWNED_LABELS}') || k == 'app.kubernetes.io/managed-by'"


class PodTemplate(ApiModel):
    """What reaches every stage pod besides what the operator builds. The operator's own fields cannot be
    overridden: its labels and annotations (`diffstage.io/*`, `app.kubernetes.io/managed-by`: CEL refuses
    them), the stage container's command, probes, ports and GPU limits, the restart policy. `securityContext`
    and `containerSecurityContext` are merged key by key over the restricted defaults (docs/crd.md);
    every `resourceClaims` entry is also claimed by the stage container (`resources.claims`)."""

    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": [
        cel(f"!has(self.labels) || !self.labels.exists(k, {_OWNED_LABEL})",
            "'podTemplate.labels: diffstage.io/* and app.kubernetes.io/managed-by are labels of the operator "
            "(it selects and fences pods by them) and cannot be set'"),
        cel(f"!has(self.annotations) || !self.annotations.exists(k, k.startsWith('{OWNED_LABELS}'))",
            "'podTemplate.annotations: diffstage.io/* are annotations of the operator and cannot be set'"),
    ]})
    node_selector: dict[str, str] | None = None
    tolerations: list[KubeObject] | None = None
    affinity: KubeObject | None = None
    env: list[KubeObject] | None = None
    volumes: list[KubeObject] | None = None
    volume_mounts: list[KubeObject] | None = None
    service_account_name: str | None = None
    priority_class_name: str | None = None
    image_pull_secrets: list[LocalObjectReference] | None = None
    # maxProperties bounds the CEL cost estimate of the owned-key rules (the API server refuses unbounded ones)
    labels: dict[str, str] | None = Field(None, max_length=MAX_POD_METADATA, description=(
        "pod labels (Kueue's queue-name, ...)"))
    annotations: dict[str, str] | None = Field(None, max_length=MAX_POD_METADATA)
    topology_spread_constraints: list[KubeObject] | None = None
    scheduler_name: str | None = Field(None, min_length=1)
    runtime_class_name: str | None = Field(None, min_length=1)
    resource_claims: list[KubeObject] | None = Field(None, description=(
        "pod resourceClaims (DRA); the stage container claims each of them"))
    security_context: KubeObject | None = Field(None, description=(
        "pod securityContext, merged over the restricted defaults (runAsNonRoot, seccomp RuntimeDefault)"))
    container_security_context: KubeObject | None = Field(None, description=(
        "the stage container's securityContext, merged over the restricted defaults (no privilege "
        "escalation, capabilities drop ALL, readOnlyRootFilesystem)"))

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

    enabled: bool = True
    http_from: list[KubeObject] | None = Field(None, description=(
        "NetworkPolicyPeers allowed on the HTTP port (8000); default: every pod in the stage's namespace. "
        "Add your ingress controller's or Prometheus' namespace here"))


class SecretKeyRef(ApiModel):
    name: str = Field(min_length=1, description="a Secret in the stage's namespace")
    key: str = Field("api-keys", min_length=1, description="its key: API keys, one a line")


class Auth(ApiModel):
    """API keys for the stage's /v1/* routes (`--api-key-file`); /health, /ready and /metrics stay open.
    The operator mounts the Secret and reads it (RBAC `get` on secrets in the namespace) for its own
    /v1/stats and /v1/abort calls, with the first key in it."""

    secret_ref: SecretKeyRef


_PRODUCT = ("self.parallel.tensorParallelSize * self.parallel.ulyssesDegree * self.parallel.ringDegree"
            " * self.parallel.cfgParallelSize * self.parallel.dataParallelSize * self.parallel.pipelineParallelSize")


class StageSpec(ApiModel):
    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": [cel(
        f"{_PRODUCT} == self.resources.gpusPerPod",
        "'parallel degrees multiply to ' + string(" + _PRODUCT + ") + ' (tensor ' + "
        "string(self.parallel.tensorParallelSize) + ' x ulysses ' + string(self.parallel.ulyssesDegree) + "
        "' x ring ' + string(self.parallel.ringDegree) + ' x cfg ' + string(self.parallel.cfgParallelSize) + "
        "' x data ' + string(self.parallel.dataParallelSize) + ' x pipeline ' + "
        "string(self.parallel.pipelineParallelSize) + ') but resources.gpusPerPod is ' + "
        "string(self.resources.gpusPerPod)",
        reason="FieldValueInvalid")]})
    model: ModelSource
    image: str = Field(DEFAULT_IMAGE, min_length=1)
    startup_timeout_seconds: int = Field(600, ge=1, le=86400, description=(
        "how long a replica may take from its container start to ready (loading weights, warmup); the "
        "stage fails with StartupTimeout beyond it, and the startup probe is sized from it"))
    replicas: int = Field(1, ge=0)
    parallel: Parallel = Field(default_factory=Parallel)
    resources: Resources = Field(default_factory=Resources)
    engine: Engine = Field(default_factory=Engine)
    restart_policy: RestartPolicy = Field(default_factory=RestartPolicy)
    health_check: HealthCheck = Field(default_factory=HealthCheck)
    abort: Abort | None = None
    autoscaling: Autoscaling = Field(default_factory=Autoscaling)
    pod_template: PodTemplate = Field(default_factory=PodTemplate)
    rollout: Rollout = Field(default_factory=Rollout)
    disruption: Disruption = Field(default_factory=Disruption)
    auth: Auth | None = None
    network_policy: NetworkPolicy = Field(default_factory=NetworkPolicy)
    # None (not []) when unset: the spec's wire form, hence its rollout digest, is unchanged for stages without it
    loras: list[LoraAdapter] | None = Field(None, max_length=64, description=(
        "LoRA adapters loaded at startup; changing the list rolls the pods"), json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
    max_loras: int | None = Field(None, ge=1, le=1024, description="resident adapters at most per replica "
                                                                   "(default 8; LRU among the unpinned)")

    @model_validator(mode="after")
    def _topology_fits(self) -> StageSpec:
        self.topology()  # ConfigError (a ValueError) names the numbers
        return self

    def topology(self) -> ParallelConfig:
        """The runtime's own topology for one pod: num_gpus is the world (GPUs or CPU rank processes)."""
        p = self.parallel
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the TP-without-Ulysses hint is for the runtime log
            try:
                return ParallelConfig(
                    tensor_parallel_size=p.tensor_parallel_size, ulysses_degree=p.ulysses_degree,
                    ring_degree=p.ring_degree, cfg_parallel_size=p.cfg_parallel_size,
                    data_parallel_size=p.data_parallel_size, pipeline_parallel_size=p.pipeline_parallel_size,
                    num_gpus=self.resources.gpus_per_pod)
            except ValueError as exc:  # pydantic's ValidationError: keep the runtime's own words
                errors = getattr(exc, "errors", None)
                text = "; ".join(e["msg"].removeprefix("Value error, ") for e in errors()) if errors else str(exc)
                raise ConfigError(f"parallel topology does not fit resources.gpusPerPod="
                                  f"{self.resources.gpus_per_pod}: {text}") from None
