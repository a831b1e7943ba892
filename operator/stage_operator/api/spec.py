"""`DiffusionStage.spec` (docs/crd.md) as pydantic models; `crdgen` turns them into the CRD schema.

CEL rules live on the types they guard (`x-kubernetes-validations`). The parallel arithmetic in CEL is the
same rule `stage_runtime.config.ParallelConfig` enforces (world size = product of degrees = GPUs per pod);
`StageSpec.topology()` asks ParallelConfig itself, so the operator never re-implements it.
"""

from __future__ import annotations

import warnings

import annotated_types
from pydantic import ConfigDict, Field, model_validator

from stage_operator.api.autoscaling import JOBS_NEED_STORE, JOBS_NEED_STORE_RULE, Autoscaling
from stage_operator.api.base import ApiModel, cel
from stage_operator.api.compile import Compile
from stage_operator.api.engine import Engine
from stage_operator.api.jobs import Jobs
from stage_operator.api.meta import DEFAULT_GPU_RESOURCE, DEFAULT_IMAGE
from stage_operator.api.model import ModelSource
from stage_operator.api.offload import SPEC_RULES as OFFLOAD_RULES
from stage_operator.api.offload import Offload, spec_refusal
from stage_operator.api.pod import Auth, NetworkPolicy, PodTemplate
from stage_operator.api.quantization import TENSOR_PARALLEL_RULE, Quantization, tensor_parallel_refusal
from stage_operator.api.routing import Routing
from stage_operator.api.sleep import Profiling, Sleep
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
    """Parallel degrees inside one pod's engine; their product is the world size (= resources.gpusPerPod).
    A degree the model's family does not run makes the stage exit 2 at startup (Stalled, InvalidConfiguration)."""

    tensor_parallel_size: int = Field(1, **_bounds("tensor_parallel_size"), description=(
        "Tensor parallel: each block's weights split over this many ranks (DiT, SD3, FLUX.1); times "
        "ulyssesDegree it must divide the attention heads. Default 1."))
    ulysses_degree: int = Field(1, **_bounds("ulysses_degree"), description=(
        "Ulysses sequence parallel: each attention's tokens split over this many ranks, traded for heads; it "
        "must divide the attention heads. Default 1."))
    ring_degree: int = Field(1, **_bounds("ring_degree"), description=(
        "Ring attention: the sequence split over this many ranks passing keys and values around a ring, "
        "across the Ulysses groups (DiT, SD3, FLUX.1, Qwen-Image). Default 1."))
    cfg_parallel_size: int = Field(1, **_bounds("cfg_parallel_size"), description=(
        "1 or 2: 2 computes the conditional and unconditional guidance branches on two ranks (not for "
        "guidance-distilled FLUX.1). Default 1."))
    data_parallel_size: int = Field(1, ge=1, description=(
        "Full model copies inside the pod, each serving its own requests. Default 1; not inferred from "
        "gpusPerPod: give it explicitly."))
    pipeline_parallel_size: int = Field(1, **_bounds("pipeline_parallel_size"), description=(
        "Pipeline parallel: not run by this runtime; above 1 the stage exits 2 at startup. Default 1."))

    @property
    def product(self) -> int:
        return (self.tensor_parallel_size * self.ulysses_degree * self.ring_degree * self.cfg_parallel_size
                * self.data_parallel_size * self.pipeline_parallel_size)


class Resources(ApiModel):
    """What each pod asks of its node: the ranks' GPUs, and the stage container's CPU and memory."""

    gpus_per_pod: int = Field(1, ge=1, description=(
        "Ranks per pod: GPUs, or CPU rank processes when gpuResourceName is \"\". Default 1; it must equal the "
        "product of the parallel degrees (CEL). No schedulable node with this many allocatable: no pod is "
        "created (Accepted=False, InsufficientGPUCapacity)."))
    gpu_resource_name: str = Field(DEFAULT_GPU_RESOURCE, description=(
        "The extended resource the stage container's limit asks gpusPerPod of (default nvidia.com/gpu); "
        "\"\" asks for none and runs the ranks as CPU processes (dev clusters)."))
    cpu: str | None = Field(None, description=(
        "The stage container's CPU request, a quantity (e.g. \"8\", 500m); no CPU limit is set. Default: none."))
    memory: str | None = Field(None, description=(
        "The stage container's memory request and limit, a quantity (e.g. 32Gi); past it the kernel kills the "
        "stage (OOMKilled) and the operator restarts it with backoff. Default: none."))
    shm_size: str | None = Field(None, description=(
        "Size limit of the memory-backed /dev/shm, a quantity (e.g. 8Gi); what it holds counts as the pod's "
        "memory. Default: no limit of its own."))


class LoraAdapter(ApiModel):
    """A LoRA adapter every replica holds (docs/lora.md): loaded at startup, and on the running replicas, live,
    when the list changes (no pod restart); requests name it in `loras`."""

    name: str = Field(pattern=LORA_NAME_PATTERN, description="The name requests give in `loras`; unique in the list.")
    path: str = Field(min_length=1, description=(
        "The adapter's safetensors file (or its folder) inside the pod: in the image or on a podTemplate volume; a "
        "relative path is inside the model folder (the built-in tiny models ship loras/ink and loras/pixel)."))
    pinned: bool = Field(True, description=(
        "true (default): never evicted to make room under maxLoras; false: evictable like adapters loaded later."))


class RestartPolicy(ApiModel):
    """Fail-closed restarts of a replica: backoff initial·2ⁿ capped; at most maxRestarts per window. A pod
    that exits 2 (a configuration error) is never restarted; evictions are replaced at once, uncounted."""

    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": [cel(
        "self.backoffInitialSeconds <= self.backoffMaxSeconds",
        "'restartPolicy.backoffInitialSeconds (' + string(self.backoffInitialSeconds) + "
        "') must not exceed backoffMaxSeconds (' + string(self.backoffMaxSeconds) + ')'")]})
    max_restarts: int = Field(5, ge=0, description=(
        "Restarts of one replica allowed inside windowSeconds (default 5; 0: none). A failure past them is not "
        "restarted: the stage is Stalled (RestartBudgetExhausted) until the pod template or restartPolicy changes."))
    window_seconds: int = Field(600, ge=1, description=(
        "The sliding window, in seconds, the restarts are counted in, for the budget and the backoff (default 600)."))
    backoff_initial_seconds: int = Field(10, ge=1, description=(
        "Seconds before the first restart, doubled for each restart already in the window (default 10); at most "
        "backoffMaxSeconds (CEL)."))
    backoff_max_seconds: int = Field(300, ge=1, description=(
        "The longest delay before a restart, in seconds (default 300)."))


class HealthCheck(ApiModel):
    """The operator's own probe of each serving pod (`/health` and `/v1/stats`): `/health` 503 fails at once;
    `failureThreshold` consecutive probes without an answer fail too. Seconds may be fractional."""

    period_seconds: float = Field(10.0, ge=0.1, le=3600, description=(
        "Seconds between probe rounds (0.1-3600, default 10); also how fresh status' waiting/running and the "
        "autoscaler's load samples are."))
    timeout_seconds: float = Field(2.0, ge=0.1, le=60, description=(
        "Timeout of each probe call and of the spec.abort calls, in seconds (0.1-60, default 2); a call past it "
        "is no answer."))
    failure_threshold: int = Field(3, ge=1, le=100, description=(
        "Probes in a row without an answer that fail a pod which had answered or was Ready (1-100, default 3): "
        "it is restarted (ProbeFailed). A stage still loading is never failed."))


class Abort(ApiModel):
    """A nonce: each new `id` aborts `requestIds` (or `all`) on every serving pod; the result is in status."""

    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": [cel(
        "has(self.requestIds) != (has(self.all) && self.all)",
        "'abort: set exactly one of requestIds or all: true'")]})
    id: str = Field(min_length=1, description=(
        "Any non-empty string; each new value makes the operator POST /v1/abort once to every running pod. "
        "Change it to abort again; status.abort.observedId is the last one carried out."))
    request_ids: list[str] | None = Field(None, description=(
        "The ids of the requests to abort (the `id` of their answers); ids no pod had are listed in "
        "status.abort.notFound. Exactly one of requestIds or all: true."))
    all: bool | None = Field(None, description=(
        "true: abort every request in flight on every pod. Exactly one of requestIds or all: true."))


class Rollout(ApiModel):
    """How a pod-template change rolls out: up to `maxSurge` extra pods (GPUs permitting) and at most
    `maxUnavailable` replicas below `replicas`; a revision that makes no progress for
    `progressDeadlineSeconds` (or exits 2, or crash-loops) is rolled back to the last Ready one."""

    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": [cel(
        "self.maxSurge + self.maxUnavailable >= 1",
        "'rollout: maxSurge (' + string(self.maxSurge) + ') and maxUnavailable (' + string(self.maxUnavailable)"
        " + ') cannot both be 0: the rollout could never replace a pod'")]})
    max_surge: int = Field(0, ge=0, description=(
        "Extra pods during a rollout (default 0), each created only when a node has gpusPerPod free GPUs."))
    max_unavailable: int = Field(1, ge=0, description=(
        "Replicas that may be below `replicas` ready during a rollout (default 1); not 0 together with maxSurge."))
    progress_deadline_seconds: int | None = Field(None, ge=1, description=(
        "Seconds without a new replica becoming ready before the rollout is rolled back; "
        "default startupTimeoutSeconds + 60."))

    @model_validator(mode="after")
    def _can_progress(self) -> Rollout:
        if self.max_surge + self.max_unavailable < 1:
            raise ValueError(f"rollout: maxSurge ({self.max_surge}) and maxUnavailable ({self.max_unavailable}) "
                             "cannot both be 0: the rollout could never replace a pod")
        return self


class Disruption(ApiModel):
    """The stage's PodDisruptionBudget (voluntary disruptions: node drains, evictions)."""

    max_unavailable: int | None = Field(None, ge=0, description=(
        "Serving replicas a voluntary disruption may take at once. Default: 1 when replicas >= 2, else no budget "
        "(one on a single replica would block every node drain); set it to get a budget there too."))


_PRODUCT = ("self.parallel.tensorParallelSize * self.parallel.ulyssesDegree * self.parallel.ringDegree"
            " * self.parallel.cfgParallelSize * self.parallel.dataParallelSize * self.parallel.pipelineParallelSize")


class StageSpec(ApiModel):
    """The stage you want: which model, how many pods of how many GPUs, and how the operator runs, restarts,
    rolls out and scales them. Only `model` is required; nested objects default to {}, so the API server
    fills their defaults. The product of the parallel degrees must equal resources.gpusPerPod, quantized weights
    need parallel.tensorParallelSize 1, autoscaling.metric jobs needs spec.jobs, and offload.mode distributed a
    data-parallel topology in request mode (CEL)."""

    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": [cel(
        f"{_PRODUCT} == self.resources.gpusPerPod",
        "'parallel degrees multiply to ' + string(" + _PRODUCT + ") + ' (tensor ' + "
        "string(self.parallel.tensorParallelSize) + ' x ulysses ' + string(self.parallel.ulyssesDegree) + "
        "' x ring ' + string(self.parallel.ringDegree) + ' x cfg ' + string(self.parallel.cfgParallelSize) + "
        "' x data ' + string(self.parallel.dataParallelSize) + ' x pipeline ' + "
        "string(self.parallel.pipelineParallelSize) + ') but resources.gpusPerPod is ' + "
        "string(self.resources.gpusPerPod)",
        reason="FieldValueInvalid"), TENSOR_PARALLEL_RULE, JOBS_NEED_STORE_RULE, *OFFLOAD_RULES]})
    model: ModelSource
    image: str = Field(DEFAULT_IMAGE, min_length=1, description=(
        f"The stage container's image (default {DEFAULT_IMAGE}), also run by the fetch-model and make-model "
        "init containers; it must hold stage-runtime. Changing it rolls the pods."))
    startup_timeout_seconds: int = Field(600, ge=1, le=86400, description=(
        "Seconds a replica may take from its container start to ready (loading weights, warmup; 1-86400, "
        "default 600); beyond it the stage exits with StartupTimeout and is restarted with backoff. The "
        "startup probe is sized from it."))
    replicas: int = Field(1, ge=0, description=(
        "Pods of the stage, one engine each (default 1; 0 stops it). kubectl scale, an HPA or KEDA set it "
        "through /scale; with autoscaling.mode Operator it is only the starting count."))
    parallel: Parallel = Field(default_factory=Parallel)
    resources: Resources = Field(default_factory=Resources)
    engine: Engine = Field(default_factory=Engine)
    compile: Compile | None = None  # None: the wire form (hence the digest) of stages without it is unchanged
    quantization: Quantization | None = None  # None: the wire form (and digest) of stages without it is unchanged
    offload: Offload | None = None  # None: the wire form (and digest) of stages without it is unchanged
    sleep: Sleep | None = None  # None: sleep mode off; the wire form (and digest) of stages without it is unchanged
    profiling: Profiling | None = None  # None: the profiler off; the same
    restart_policy: RestartPolicy = Field(default_factory=RestartPolicy)
    health_check: HealthCheck = Field(default_factory=HealthCheck)
    abort: Abort | None = None
    autoscaling: Autoscaling = Field(default_factory=Autoscaling)
    pod_template: PodTemplate = Field(default_factory=PodTemplate)
    rollout: Rollout = Field(default_factory=Rollout)
    disruption: Disruption = Field(default_factory=Disruption)
    auth: Auth | None = None
    jobs: Jobs | None = None  # None: the job API is off; the wire form (hence the digest) of other stages is unchanged
    network_policy: NetworkPolicy = Field(default_factory=NetworkPolicy)
    routing: Routing | None = None  # None: no change to the wire form (and digest) of stages without it
    # None (not true) when unset: the same; the page is on unless this is false
    playground: bool | None = Field(None, description=(
        "The playground page at / of each replica, to try the stage in a browser (kubectl port-forward to its "
        "Service): on unless false (serve --no-playground). It calls the stage's own API: with spec.auth it asks for "
        "a key like any client."))
    # None (not []) when unset: the spec's wire form, hence its rollout digest, is unchanged for stages without it
    loras: list[LoraAdapter] | None = Field(None, max_length=64, description=(
        "LoRA adapters every replica holds (at most 64, unique names): loaded at startup, and a changed list is "
        "loaded and unloaded live on the running replicas, without restarting them (status.loraSync)."), json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
    max_loras: int | None = Field(None, ge=1, le=1024, description=(
        "Adapters resident at most per replica (1-1024, default 8); a load past it evicts the least recently "
        "used unpinned one."))

    @model_validator(mode="after")
    def _topology_fits(self) -> StageSpec:
        self.topology()  # ConfigError (a ValueError) names the numbers
        tp = self.parallel.tensor_parallel_size
        if self.quantization is not None and self.quantization.enabled and tp > 1:
            raise ValueError(tensor_parallel_refusal(self.quantization.method, tp))
        if self.autoscaling.metric == "jobs" and self.jobs is None:
            raise ValueError(JOBS_NEED_STORE)
        if refusal := spec_refusal(self):
            raise ValueError(refusal)
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
