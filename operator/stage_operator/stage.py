"""A DiffusionStage as the operator sees it: identity, generation, the parsed spec (or why it is invalid)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from stage_operator.api.meta import API_VERSION, KIND
from stage_operator.api.spec import StageSpec


@dataclass(frozen=True)
class Stage:
    name: str
    namespace: str
    uid: str
    generation: int
    spec: StageSpec | None  # None when the spec is invalid: `error` says why
    error: str | None = None
    status: Mapping[str, Any] = field(default_factory=dict)
    deleting: bool = False

    @property
    def wants_inference_pool(self) -> bool:
        """spec.routing.inferencePool is set (and the stage is not being deleted: then garbage collection has it)."""
        return (self.spec is not None and not self.deleting and self.spec.routing is not None
                and self.spec.routing.inference_pool is not None)

    def owner_reference(self) -> dict[str, Any]:
        return {"apiVersion": API_VERSION, "kind": KIND, "name": self.name, "uid": self.uid,
                "controller": True, "blockOwnerDeletion": True}


def format_validation_error(exc: ValidationError) -> str:
    """One line naming each bad field and its value: `spec.replicas=-1: Input should be ...`."""
    problems = []
    for err in exc.errors(include_url=False):
        loc = ".".join(["spec", *(str(p) for p in err["loc"])])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            problems.append(f"unknown field {loc}")
        elif err["type"] == "missing":
            problems.append(f"{loc}: field required")
        elif isinstance(err.get("input"), dict):
            problems.append(f"{loc}: {msg}")
        else:
            problems.append(f"{loc}={err.get('input')!r}: {msg}")
    return "; ".join(problems)


def parse_stage(body: Mapping[str, Any]) -> Stage:
    meta = body["metadata"]
    try:
        spec, error = StageSpec.model_validate(body.get("spec") or {}), None
    except ValidationError as exc:
        spec, error = None, format_validation_error(exc)
    return Stage(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"],
                 generation=int(meta.get("generation") or 1), spec=spec, error=error,
                 status=dict(body.get("status") or {}), deleting=bool(meta.get("deletionTimestamp")))
