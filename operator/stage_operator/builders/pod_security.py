"""The stage pod's security defaults: the Pod Security Standards `restricted` profile, and the writable places a
read-only root filesystem leaves the stage (pure).

    pod        runAsNonRoot, runAsUser/runAsGroup/fsGroup 65532 (the images' user), seccomp RuntimeDefault
    container  allowPrivilegeEscalation false, capabilities drop ALL, readOnlyRootFilesystem
               (every container the operator builds: the stage and its init containers)

What the stage writes, and where it goes with a read-only root:
    /tmp         emptyDir `stage-tmp`: tempfile (the mp executor's ipc sockets), HF_HOME=/tmp/hf in the images
    /dev/shm     emptyDir `dshm` (Memory): the engine's shared-memory tensors (already there)
    the model    emptyDir per source (builders.model_delivery), the node cache volume
    termination  /dev/termination-log, mounted by the kubelet

`podTemplate.securityContext` and `podTemplate.containerSecurityContext` are merged key by key over these
defaults: a key the user sets replaces the default's value (so `capabilities: {add: [...]}` replaces the
whole capabilities object); the rest stays restricted.
"""

from __future__ import annotations

from typing import Any

from stage_operator.api.spec import PodTemplate

STAGE_USER = 65532  # USER 65532:65532 in images/runtime and images/runtime-cuda
POD_DEFAULTS: dict[str, Any] = {"runAsNonRoot": True, "runAsUser": STAGE_USER, "runAsGroup": STAGE_USER,
                                "fsGroup": STAGE_USER, "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_DEFAULTS: dict[str, Any] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                      "readOnlyRootFilesystem": True}
TMP_VOLUME = {"name": "stage-tmp", "emptyDir": {}}
TMP_MOUNT = {"name": "stage-tmp", "mountPath": "/tmp"}


def pod_security_context(tpl: PodTemplate) -> dict[str, Any]:
    return {**POD_DEFAULTS, **(tpl.security_context or {})}


def container_security_context(tpl: PodTemplate) -> dict[str, Any]:
    return {**CONTAINER_DEFAULTS, **(tpl.container_security_context or {})}


def harden(pod_spec: dict[str, Any], tpl: PodTemplate) -> dict[str, Any]:
    """The pod spec with the security contexts set; the init containers get /tmp too (the stage container
    has it from builders.pod, before the user's mounts). A copy."""
    context = container_security_context(tpl)
    out = {**pod_spec, "securityContext": pod_security_context(tpl),
           "containers": [{**c, "securityContext": dict(context)} for c in pod_spec["containers"]]}
    if init := pod_spec.get("initContainers"):
        out["initContainers"] = [{**c, "securityContext": dict(context),
                                  "volumeMounts": [*(c.get("volumeMounts") or ()), dict(TMP_MOUNT)]} for c in init]
    return out
