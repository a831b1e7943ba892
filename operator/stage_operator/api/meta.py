"""Names the CRD, the children and the labels share: one place, so builders, selectors and tests agree."""

GROUP = "diffstage.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DiffusionStage"
PLURAL = "diffusionstages"
SINGULAR = "diffusionstage"
SHORT_NAMES = ("dstage",)

LABEL_STAGE = f"{GROUP}/stage"
LABEL_REPLICA = f"{GROUP}/replica"
LABEL_SERVING = f"{GROUP}/serving"
LABEL_TEMPLATE_HASH = f"{GROUP}/template-hash"
ANNOTATION_DRAINING = f"{GROUP}/draining-since"  # set when the drain fences the pod (every deletion)
ANNOTATION_DRAIN_REASON = f"{GROUP}/drain-reason"  # why it leaves: ScaleDown, Outdated, StageDeleted
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "diffstage-operator"
# The inference gateway's endpoint picker chooses how to read a pod's /metrics by this label (its engineConfigs:
# manifests/inference-gateway/endpoint-picker-config.yaml); podTemplate.labels may set another value.
LABEL_ENGINE_TYPE = "llm-d.ai/engine-type"
ENGINE_TYPE = "diffstage"

OPERATOR_NAMESPACE = "diffstage-system"  # manifests/base: where the operator's pods run (NetworkPolicy peer)
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "diffstage-operator"}

HTTP_PORT = 8000
ZMQ_PORT = 5570
TERMINATION_LOG = "/dev/termination-log"
CONFIG_DIR = "/etc/diffstage"
CONFIG_FILE = "stage.yaml"
BUILTIN_MODEL_DIR = "/opt/diffstage/models"  # where the runtime image keeps `make-tiny-model` outputs
MODEL_DIR = "/opt/diffstage/model"  # emptyDir an init container fills (source.uri, source.image without image volumes)
MODEL_SOURCE_DIR = "/opt/diffstage/model-source"  # source.pvc, read-only
MODEL_IMAGE_DIR = "/opt/diffstage/model-image"  # source.image as an image volume, read-only
MODEL_CACHE_DIR = "/var/cache/diffstage"  # the node-local cache (model.cache) in the fetch and stage containers
COMPILE_CACHE_DIR = "/var/cache/diffstage-compile"  # spec.compile.cache, else an emptyDir: compiled artifacts
COMPILE_IN_MODEL_CACHE = f"{MODEL_CACHE_DIR}/compile"  # without compile.cache but with model.cache: a folder of it
AUTH_DIR = "/etc/diffstage-auth"  # spec.auth.secretRef, mounted read-only
API_KEY_FILE = f"{AUTH_DIR}/api-keys"
JOBS_DIR = "/var/lib/diffstage/jobs"  # spec.jobs.claimName, mounted read-write: the stage's jobs.store
PROFILES_DIR = "/var/lib/diffstage/profiles"  # spec.profiling.volume (default an emptyDir): the stage's profiler.dir
DEFAULT_IMAGE = "diffstage/runtime:0.1.0"
DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"


def stage_selector(stage: str) -> dict[str, str]:
    """Labels that select every pod of a stage (the scale subresource's selector)."""
    return {LABEL_STAGE: stage}


def serving_selector(stage: str) -> dict[str, str]:
    """Labels the Service selects: the stage's pods that are not fenced out of traffic."""
    return {LABEL_STAGE: stage, LABEL_SERVING: "true"}


def selector_string(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
