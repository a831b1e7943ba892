"""Where a stage with `spec.compile` keeps its compiled artifacts (the stage config's `compile.cache_dir`), and the
volume that holds them (pure):

    compile.cache.hostPath   hostPath `compile-cache` (DirectoryOrCreate)   COMPILE_CACHE_DIR     warm per node
    compile.cache.pvc        the claim `compile-cache`, read-write          COMPILE_CACHE_DIR     warm wherever mounted
    else model.cache         the model cache volume builders.model_delivery  COMPILE_IN_MODEL_CACHE  warm per node
                             already mounts in the stage container (source.uri)
    else                     emptyDir `compile-cache`                       COMPILE_CACHE_DIR     cold at every start

The model cache's LRU eviction (stage_runtime.fetch.cache) sizes and removes only its `models/` entries: a
`compile/` folder beside them is neither counted in `maxBytes` nor evicted. A hostPath only when the user named
one (compile.cache.hostPath or model.cache.hostPath): every other case is admitted by the restricted Pod
Security level. The operator restarts a replica as a new pod (restartPolicy Never), so the emptyDir never
outlives the replica's start: without a cache every start compiles cold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stage_operator.api.meta import COMPILE_CACHE_DIR, COMPILE_IN_MODEL_CACHE
from stage_operator.api.spec import StageSpec

VOLUME = "compile-cache"


@dataclass(frozen=True)
class CompileCache:
    cache_dir: str | None  # None: nothing is compiled (no compile, or mode none)
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)  # the stage container's


def compile_cache(spec: StageSpec) -> CompileCache:
    if spec.compile is None or not spec.compile.enabled:
        return CompileCache(None)
    mount = {"name": VOLUME, "mountPath": COMPILE_CACHE_DIR}
    cache = spec.compile.cache
    if cache is not None and cache.host_path:
        volume = {"name": VOLUME, "hostPath": {"path": cache.host_path, "type": "DirectoryOrCreate"}}
        return CompileCache(COMPILE_CACHE_DIR, [volume], [mount])
    if cache is not None:
        return CompileCache(COMPILE_CACHE_DIR, [{"name": VOLUME, "persistentVolumeClaim": {
            "claimName": cache.pvc.claim_name}}], [mount])
    if spec.model.cache is not None:  # mounted at MODEL_CACHE_DIR by builders.model_delivery (source.uri)
        return CompileCache(COMPILE_IN_MODEL_CACHE)
    return CompileCache(COMPILE_CACHE_DIR, [{"name": VOLUME, "emptyDir": {}}], [mount])
