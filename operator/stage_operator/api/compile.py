"""`spec.compile`: the denoiser compiled at warm-up (the stage config's `compile:`, `stage_runtime.config.CompileConfig`).

The bounds, the shape pattern and the most shapes are the runtime's own (read from its config module), so the CRD
never admits what the stage would refuse at startup. The fields map onto the stage's `compile:` section
(builders.runtime_config, only when `mode` is not none): mode → `mode`, shapes → `shapes`, maxGraphs → `max_graphs`,
timeoutSeconds → `timeout_s`, and the folder the artifacts are kept in → `cache_dir` (builders.compile_cache: this
`cache`, else a `compile` folder of the node's model cache, else an emptyDir).
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import annotated_types
from pydantic import ConfigDict, Field, model_validator

from stage_operator.api.base import ApiModel, cel, check_exactly_one, exactly_one
from stage_operator.api.model import CacheClaim
from stage_runtime.config import MAX_SHAPES, CompileConfig
from stage_runtime.config import SHAPE_PATTERN as RUNTIME_SHAPE_PATTERN

_CAMEL = ApiModel.model_config
SHAPE_PATTERN = RUNTIME_SHAPE_PATTERN.pattern
SHAPE_MAX_LENGTH = 17  # three numbers of at most 5 digits and two x's: 99999x99999x99999


def _bounds(field: str) -> dict[str, int]:
    """Whole ge/le of a CompileConfig field (gt becomes ge of the next whole number)."""
    out: dict[str, int] = {}
    for m in CompileConfig.model_fields[field].metadata:
        if isinstance(m, annotated_types.Ge):
            out["ge"] = math.ceil(m.ge)
        elif isinstance(m, annotated_types.Gt):
            out["ge"] = math.floor(m.gt) + 1
        elif isinstance(m, annotated_types.Le):
            out["le"] = math.floor(m.le)
    return out


def _default(field: str) -> int:
    return int(CompileConfig.model_fields[field].default)


class CompileCache(ApiModel):
    """Where the compiled artifacts (inductor's and AOTAutograd's caches) are kept, so that a replica started again on
    the same node (or, with a shared claim, anywhere) compiles warm: exactly one of hostPath or pvc, mounted in the
    stage container at /var/cache/diffstage-compile. Without it: a compile folder of model.cache when that is set,
    else an emptyDir (cold at every replica start)."""

    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": [
        exactly_one(("hostPath", "pvc"), "compile.cache")]})
    host_path: str | None = Field(None, pattern=r"^/", max_length=1024, description=(
        "An absolute folder on the node, created if missing; it must be writable by the runtime image's user (uid "
        "65532). The baseline and restricted Pod Security levels forbid hostPath volumes: use pvc there."))
    pvc: CacheClaim | None = None

    @model_validator(mode="after")
    def _one(self) -> CompileCache:
        check_exactly_one(self, ("host_path", "pvc"), "compile.cache")
        return self


_DUPLICATE = "self.shapes.filter(s, self.shapes.filter(t, t == s).size() > 1)"
Shape = Annotated[str, Field(pattern=SHAPE_PATTERN, max_length=SHAPE_MAX_LENGTH, description=(
    "WIDTHxHEIGHT (an image, e.g. 1024x1024) or WIDTHxHEIGHTxFRAMES (a video, e.g. 832x480x81), as a request's "
    "size."))]


class Compile(ApiModel):
    """The denoiser compiled with torch.compile while the replica warms up (it reports Ready only after that), for
    faster steps than eager at the price of a cold compile. Off (none) by default: the exact eager path stays the
    reference. A compile that fails or runs past timeoutSeconds falls back to eager: the replica still serves, and the
    stage's Compiled condition says so (False, CompileFallback, with the runtime's reason). Every field is a startup
    setting: changing one rolls the pods."""

    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": [cel(
        f"!has(self.shapes) || {_DUPLICATE}.size() == 0",
        f"'compile.shapes lists ' + {_DUPLICATE}[0] + ' twice: each shape is compiled once'")]})
    mode: Literal["none", "auto", "regional", "full"] = Field("none", description=(
        "none (default): eager, what the bare diffusers pipeline computes; regional: each repeated block class of the "
        "denoiser compiled once and shared by every block of that class (compile time does not grow with depth); "
        "full: the denoiser's whole forward; auto: the mode the runtime's shipped measurements found faster for this "
        "model family on this kind of device, else none."))
    shapes: list[Shape] | None = Field(None, max_length=MAX_SHAPES, description=(
        f"The output sizes compiled at warm-up, at most {MAX_SHAPES}, each once: WIDTHxHEIGHT or "
        "WIDTHxHEIGHTxFRAMES (e.g. 1024x1024, 832x480x81). Default: the model's default size. A request at another "
        "size compiles a new graph when it first comes (up to maxGraphs)."))
    max_graphs: int = Field(_default("max_graphs"), **_bounds("max_graphs"), description=(
        f"Graphs one rank may compile (1-4096, default {_default('max_graphs')}); past it a call that would need a "
        "new graph runs eagerly instead (never a recompile storm)."))
    timeout_seconds: int = Field(_default("timeout_s"), **_bounds("timeout_s"), description=(
        f"Seconds the warm-up may spend compiling (1-86400, default {_default('timeout_s')}); past it the replica "
        "serves eagerly and says so (Compiled=False, CompileFallback). Counted inside startupTimeoutSeconds: raise "
        "that too for a large model's cold compile."))
    cache: CompileCache | None = None

    @model_validator(mode="after")
    def _runtime_accepts(self) -> Compile:
        shapes = list(self.shapes or ())
        if twice := [s for s in shapes if shapes.count(s) > 1]:
            raise ValueError(f"compile.shapes lists {twice[0]} twice: each shape is compiled once")
        self.runtime(None)  # the runtime's own checks (a ValueError naming the field), so the stage never refuses it
        return self

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def runtime(self, cache_dir: str | None) -> CompileConfig:
        """The stage config's `compile:` section for artifacts kept in `cache_dir`."""
        return CompileConfig(mode=self.mode, cache_dir=cache_dir, shapes=tuple(self.shapes or ()),
                             max_graphs=self.max_graphs, timeout_s=float(self.timeout_seconds))
