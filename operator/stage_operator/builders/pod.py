"""One pod per replica, `<stage>-<index>`: restartPolicy Never (the operator owns restarts), GPU limits from
the spec, probes on /ready and /health, the termination log. The template hash labels outdated pods."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from stage_operator.api.jobs import CREDENTIAL_KEYS
from stage_operator.api.meta import (API_KEY_FILE, AUTH_DIR, CONFIG_DIR, ENGINE_TYPE, HTTP_PORT, JOBS_DIR,
                                     LABEL_ENGINE_TYPE, LABEL_REPLICA, LABEL_SERVING, LABEL_TEMPLATE_HASH,
                                     PROFILES_DIR, TERMINATION_LOG, ZMQ_PORT)
from stage_operator.api.spec import StageSpec
from stage_operator.builders.children import build_configmap, configmap_name, owned_metadata, stage_labels
from stage_operator.builders.compile_cache import compile_cache
from stage_operator.builders.model_delivery import model_delivery
from stage_operator.builders.pod_security import TMP_MOUNT, TMP_VOLUME, harden
from stage_operator.builders.runtime_config import serve_command
from stage_operator.stage import Stage

CONTAINER = "stage"
READINESS_PROBE = {"periodSeconds": 5, "timeoutSeconds": 2, "failureThreshold": 2}
LIVENESS_PROBE = {"periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3}
# A deletion the operator did not drain (an eviction, `kubectl delete pod`): the pod stays in the Service's
# endpoints until they catch up, so the stage gets SIGTERM only after this pause, then drains itself.
PRE_STOP_SECONDS = 5


def pod_name(stage: Stage, index: int) -> str:
    return f"{stage.name}-{index}"


def _resources(stage: Stage) -> dict[str, Any]:
    r = stage.spec.resources
    limits: dict[str, str] = {r.gpu_resource_name: str(r.gpus_per_pod)} if r.gpu_resource_name else {}
    requests: dict[str, str] = {}
    if r.cpu:
        requests["cpu"] = r.cpu
    if r.memory:
        requests["memory"] = limits["memory"] = r.memory
    out: dict[str, Any] = {}
    if limits:
        out["limits"] = limits
    if requests:
        out["requests"] = requests
    return out


def _claims(stage: Stage) -> list[dict[str, str]]:
    """The stage container claims every pod resourceClaim (DRA devices are the stage's)."""
    return [{"name": c["name"]} for c in stage.spec.pod_template.resource_claims or () if c.get("name")]


def _auth(spec: StageSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """spec.auth.secretRef as a read-only secret volume holding the one file `--api-key-file` reads."""
    if spec.auth is None:
        return [], []
    ref = spec.auth.secret_ref
    volume = {"name": "api-keys", "secret": {"secretName": ref.name, "defaultMode": 0o444,
                                             "items": [{"key": ref.key, "path": API_KEY_FILE.rsplit("/", 1)[1]}]}}
    return [volume], [{"name": "api-keys", "mountPath": AUTH_DIR, "readOnly": True}]


JOBS_VOLUME = "jobs-store"


def _object_store_env(spec: StageSpec) -> list[dict[str, Any]]:
    """spec.jobs.objectStore.credentialsSecret's keys as the standard AWS environment, each named (secretKeyRef, not
    envFrom: no other key of the Secret reaches the process); the session token optional."""
    bucket = spec.jobs.object_store if spec.jobs is not None else None
    if bucket is None or bucket.credentials_secret is None:
        return []
    return [{"name": key, "valueFrom": {"secretKeyRef": {"name": bucket.credentials_secret, "key": key,
                                                          **({"optional": True} if optional else {})}}}
            for key, optional in CREDENTIAL_KEYS]


def _jobs(spec: StageSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """spec.jobs.claimName, mounted read-write at JOBS_DIR (the stage config's jobs.store): a claim, never a
    hostPath, so the restricted Pod Security level admits it; fsGroup makes its files the stage user's."""
    if spec.jobs is None or spec.jobs.claim_name is None:
        return [], []
    volume = {"name": JOBS_VOLUME, "persistentVolumeClaim": {"claimName": spec.jobs.claim_name}}
    return [volume], [{"name": JOBS_VOLUME, "mountPath": JOBS_DIR}]


PROFILES_VOLUME = "profiles"


def _profiles(spec: StageSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """spec.profiling's volume at PROFILES_DIR (the stage config's profiler.dir), read-write: its claim, else an
    emptyDir (sizeLimit when given). Never a hostPath, so the restricted Pod Security level admits it."""
    if spec.profiling is None:
        return [], []
    volume = spec.profiling.volume
    if volume is not None and volume.pvc is not None:
        source: dict[str, Any] = {"persistentVolumeClaim": {"claimName": volume.pvc.claim_name}}
    else:
        limit = volume.empty_dir.size_limit if volume is not None and volume.empty_dir is not None else None
        source = {"emptyDir": {"sizeLimit": limit} if limit else {}}
    return [{"name": PROFILES_VOLUME, **source}], [{"name": PROFILES_VOLUME, "mountPath": PROFILES_DIR}]


def _probe(path: str, settings: dict[str, int]) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, **settings}


def startup_probe(spec: StageSpec) -> dict[str, int]:
    """The kubelet's budget from `startupTimeoutSeconds`, two periods past it: the stage enforces the budget
    itself (`--startup-timeout`: StartupTimeout naming the phase it was in); the probe is the backstop for a
    process that stops answering altogether."""
    budget = spec.startup_timeout_seconds
    period = 5 if budget >= 30 else 1
    return {"periodSeconds": period, "timeoutSeconds": min(2, period), "failureThreshold": -(-budget // period) + 2}


def build_pod_spec(stage: Stage, image_volumes: bool = False) -> dict[str, Any]:
    """The part every replica shares (the replica index reaches the process through the downward API).
    `image_volumes`: whether the cluster supports image volumes (what `model.imageVolume: auto` follows)."""
    spec = stage.spec
    assert spec is not None, "build pods only for a valid spec"
    tpl = spec.pod_template
    shm: dict[str, Any] = {"medium": "Memory"}
    if spec.resources.shm_size:
        shm["sizeLimit"] = spec.resources.shm_size
    volumes: list[dict[str, Any]] = [{"name": "stage-config", "configMap": {"name": configmap_name(stage)}},
                                     {"name": "dshm", "emptyDir": shm}, dict(TMP_VOLUME)]
    mounts: list[dict[str, Any]] = [{"name": "stage-config", "mountPath": CONFIG_DIR, "readOnly": True},
                                    {"name": "dshm", "mountPath": "/dev/shm"}, dict(TMP_MOUNT)]
    delivery = model_delivery(spec, image_volumes)
    volumes += delivery.volumes
    mounts += delivery.mounts
    init_containers = delivery.init_containers
    auth_volumes, auth_mounts = _auth(spec)
    volumes += auth_volumes
    mounts += auth_mounts
    jobs_volumes, jobs_mounts = _jobs(spec)
    volumes += jobs_volumes
    mounts += jobs_mounts
    compiled = compile_cache(spec)
    volumes += compiled.volumes
    mounts += compiled.mounts
    profile_volumes, profile_mounts = _profiles(spec)
    volumes += profile_volumes
    mounts += profile_mounts
    env = [{"name": "HF_HUB_OFFLINE", "value": "1"}, {"name": "DIFFSTAGE_STAGE", "value": stage.name},
           {"name": "DIFFSTAGE_REPLICA",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{LABEL_REPLICA}']"}}}, *_object_store_env(spec)]
    container = {
        "name": CONTAINER, "image": spec.image, "command": serve_command(spec, stage.name),
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
                  {"name": "zmq", "containerPort": ZMQ_PORT, "protocol": "TCP"}],
        "env": env + list(tpl.env or []),
        "resources": {**_resources(stage), **({"claims": claims} if (claims := _claims(stage)) else {})},
        "startupProbe": _probe("/ready", startup_probe(spec)),
        "readinessProbe": _probe("/ready", READINESS_PROBE),
        "livenessProbe": _probe("/health", LIVENESS_PROBE),
        "terminationMessagePath": TERMINATION_LOG, "terminationMessagePolicy": "FallbackToLogsOnError",
        "lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_SECONDS}}},
        "volumeMounts": mounts + list(tpl.volume_mounts or []),
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": PRE_STOP_SECONDS + spec.autoscaling.drain_timeout_seconds + 10,
        "containers": [container],
        "volumes": volumes + list(tpl.volumes or []),
    }
    if init_containers:
        pod_spec["initContainers"] = init_containers
    for key, value in (("nodeSelector", tpl.node_selector), ("tolerations", tpl.tolerations),
                       ("affinity", tpl.affinity), ("serviceAccountName", tpl.service_account_name),
                       ("priorityClassName", tpl.priority_class_name),
                       ("topologySpreadConstraints", tpl.topology_spread_constraints),
                       ("schedulerName", tpl.scheduler_name), ("runtimeClassName", tpl.runtime_class_name),
                       ("resourceClaims", tpl.resource_claims)):
        if value:
            pod_spec[key] = value
    if tpl.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [s.wire() for s in tpl.image_pull_secrets]
    return harden(pod_spec, tpl)


def template_hash(stage: Stage, image_volumes: bool = False) -> str:
    """Changes exactly when a replica built now would differ: the pod spec and the stage config it mounts (but
    its startup LoRA list, which changes live)."""
    tpl = stage.spec.pod_template
    metadata = [tpl.labels or {}, tpl.annotations or {}] if tpl.labels or tpl.annotations else []  # new pods carry them
    # spec.loras is left out: a changed list is loaded live on the replicas (lora_sync), not rolled
    payload = json.dumps([build_pod_spec(stage, image_volumes), build_configmap(stage, loras=())["data"], *metadata],
                         sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:10]


def build_pod(stage: Stage, index: int, pod_hash: str | None = None, image_volumes: bool = False) -> dict[str, Any]:
    """The user's podTemplate labels and annotations first, the operator's over them (CEL refuses the
    operator's keys in the template; this order keeps them the operator's even without admission). The endpoint
    picker's engine label is a default the template may override (it is not in the template hash: adding it
    rolls no pod; pods made before it carry it once replaced)."""
    tpl = stage.spec.pod_template
    labels = {LABEL_ENGINE_TYPE: ENGINE_TYPE, **(tpl.labels or {}), **stage_labels(stage), LABEL_REPLICA: str(index), LABEL_SERVING: "true",
              LABEL_TEMPLATE_HASH: pod_hash or template_hash(stage, image_volumes)}
    metadata = owned_metadata(stage, pod_name(stage, index), labels)
    if tpl.annotations:
        metadata["annotations"] = dict(tpl.annotations)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": build_pod_spec(stage, image_volumes)}
