"""How `spec.model` reaches the stage container (pure): the volumes, mounts and init containers per source,
and the folder the stage is told to serve (`--model`).

    builtin    emptyDir + init `make-model` (stage-runtime make-tiny-model)     BUILTIN_MODEL_DIR/<name>
    path       nothing: the folder is in the image or a podTemplate volume      the path as given
    pvc        the claim, read-only (subPath on the mount)                      MODEL_SOURCE_DIR
    image      image volume, read-only, image.path as the mount's subPath           MODEL_IMAGE_DIR
               or, without image volumes, an emptyDir there + init `copy-model` running that image
               (`cp -R <image.path>/. MODEL_IMAGE_DIR`: the image needs a `cp`, e.g. FROM busybox)
    uri        emptyDir + init `fetch-model` (stage-runtime fetch-model, verified; with `cache` the node's
               cache volume is mounted in both containers and the pipeline is a link into it)
                                                                                 MODEL_DIR/pipeline
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stage_operator.api.meta import (BUILTIN_MODEL_DIR, MODEL_CACHE_DIR, MODEL_DIR, MODEL_IMAGE_DIR,
                                     MODEL_SOURCE_DIR, TERMINATION_LOG)
from stage_operator.api.spec import StageSpec

PIPELINE = f"{MODEL_DIR}/pipeline"
INIT_FETCH, INIT_COPY, INIT_MAKE = "fetch-model", "copy-model", "make-model"


@dataclass(frozen=True)
class Delivery:
    model_dir: str
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)  # the stage container's
    init_containers: list[dict[str, Any]] = field(default_factory=list)


def uses_image_volume(spec: StageSpec, cluster_has_image_volumes: bool) -> bool:
    mode = spec.model.image_volume
    return mode == "always" or (mode == "auto" and cluster_has_image_volumes)


def _init(name: str, image: str, command: list[str], mounts: list[dict[str, Any]],
          pull_policy: str | None = None) -> dict[str, Any]:
    out = {"name": name, "image": image, "command": command, "volumeMounts": mounts,
           "terminationMessagePath": TERMINATION_LOG, "terminationMessagePolicy": "FallbackToLogsOnError"}
    if pull_policy:
        out["imagePullPolicy"] = pull_policy
    return out


def _cache_volume(spec: StageSpec) -> dict[str, Any]:
    cache = spec.model.cache
    if cache.host_path:
        return {"name": "model-cache", "hostPath": {"path": cache.host_path, "type": "DirectoryOrCreate"}}
    return {"name": "model-cache", "persistentVolumeClaim": {"claimName": cache.pvc.claim_name}}


def _uri(spec: StageSpec) -> Delivery:
    uri = spec.model.source.uri
    model = {"name": "model", "mountPath": MODEL_DIR}
    volumes, mounts = [{"name": "model", "emptyDir": {}}], [model]
    command = ["stage-runtime", "fetch-model", uri.url, PIPELINE, "--sha256", uri.sha256]
    if spec.model.cache is not None:
        volumes.append(_cache_volume(spec))
        mounts.append({"name": "model-cache", "mountPath": MODEL_CACHE_DIR})
        command += ["--cache", MODEL_CACHE_DIR, "--max-bytes", str(spec.model.cache.max_bytes)]
    command += ["--termination-log", TERMINATION_LOG]
    return Delivery(PIPELINE, volumes, mounts, [_init(INIT_FETCH, spec.image, command, list(mounts))])


def _image(spec: StageSpec, image_volume: bool) -> Delivery:
    image = spec.model.source.image
    if image_volume:
        source = {"reference": image.reference, **({"pullPolicy": image.pull_policy} if image.pull_policy else {})}
        mount = {"name": "model-image", "mountPath": MODEL_IMAGE_DIR, "readOnly": True}
        if sub_path := image.path.strip("/"):
            mount["subPath"] = sub_path
        return Delivery(MODEL_IMAGE_DIR, [{"name": "model-image", "image": source}], [mount])
    mount = {"name": "model-image", "mountPath": MODEL_IMAGE_DIR}
    copy = ["cp", "-R", f"{image.path.rstrip('/')}/.", MODEL_IMAGE_DIR]
    return Delivery(MODEL_IMAGE_DIR, [{"name": "model-image", "emptyDir": {}}], [{**mount, "readOnly": True}],
                    [_init(INIT_COPY, image.reference, copy, [mount], image.pull_policy)])


def _pvc(spec: StageSpec) -> Delivery:
    pvc = spec.model.source.pvc
    mount = {"name": "model-source", "mountPath": MODEL_SOURCE_DIR, "readOnly": pvc.read_only}
    if pvc.sub_path:
        mount["subPath"] = pvc.sub_path
    volume = {"name": "model-source", "persistentVolumeClaim": {"claimName": pvc.claim_name, "readOnly": pvc.read_only}}
    return Delivery(MODEL_SOURCE_DIR, [volume], [mount])


def model_delivery(spec: StageSpec, cluster_has_image_volumes: bool = False) -> Delivery:
    model = spec.model
    if model.builtin:
        folder = f"{BUILTIN_MODEL_DIR}/{model.builtin}"
        mount = {"name": "builtin-models", "mountPath": BUILTIN_MODEL_DIR}
        make = ["stage-runtime", "make-tiny-model", folder, "--kind", model.builtin.removeprefix("tiny-")]
        return Delivery(folder, [{"name": "builtin-models", "emptyDir": {}}], [mount],
                        [{"name": INIT_MAKE, "image": spec.image, "command": make, "volumeMounts": [mount]}])
    if model.path:
        return Delivery(model.path)
    kind = model.source.kind
    if kind == "uri":
        return _uri(spec)
    if kind == "image":
        return _image(spec, uses_image_volume(spec, cluster_has_image_volumes))
    return _pvc(spec)


def model_identity(spec: StageSpec) -> dict[str, Any]:
    """`status.model`'s source and digest, from the spec alone."""
    model = spec.model
    if model.builtin:
        return {"source": f"builtin:{model.builtin}"}
    if model.path:
        return {"source": f"path:{model.path}"}
    src = model.source
    if src.uri is not None:
        return {"source": f"uri:{src.uri.url}", "digest": f"sha256:{src.uri.sha256}"}
    if src.image is not None:
        ref = src.image.reference
        return {"source": f"image:{ref}", **({"digest": ref.split("@", 1)[1]} if "@sha256:" in ref else {})}
    return {"source": f"pvc:{src.pvc.claim_name}" + (f"/{src.pvc.sub_path}" if src.pvc.sub_path else "")}
