"""Pod-template revisions and automatic rollback (pure): which revision the pods are built from now.

Every template hash the spec produced is kept in `status.rollout.revisions` (hash, spec digest, generation,
when it was first Ready or why it failed; the last few). When every replica runs the current revision ready,
it becomes the stable revision and its spec is kept in `status.rollout.stableSpec`, so a rollback never
depends on Git. A rollout toward a new revision fails when one of its pods exits 2 (a configuration error),
crash-loops (fails again after a restart within this rollout), or no new replica becomes ready within
`rollout.progressDeadlineSeconds`. Then the pods are built from the stable spec again (with today's
`replicas`), the rollout's pods leave, and the stage reports Degraded/RolloutFailed with the failing pod's
own words — no restart is counted for it. The next spec change that moves the template hash rolls forward.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from stage_operator.api.spec import StageSpec
from stage_operator.builders.pod import template_hash
from stage_operator.clock import format_time, parse_time
from stage_operator.observed import PodView
from stage_operator.stage import Stage

HISTORY = 5
INVALID_CONFIG_EXIT = 2


@dataclasses.dataclass(frozen=True)
class Target:
    template: Stage  # the stage whose spec builds the pods and the ConfigMap now
    desired_hash: str
    status: dict[str, Any]  # the new status.rollout
    failed: tuple[str, str] | None = None  # (reason, message) while rolled back
    events: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    requeue_after: float | None = None


def spec_digest(spec: StageSpec) -> str:
    return hashlib.sha256(json.dumps(spec.wire(), sort_keys=True).encode()).hexdigest()[:16]


def _template_stage(stage: Stage, stable_spec: Mapping[str, Any]) -> Stage | None:
    """The stable spec with today's replicas and abort (neither is part of the pod template)."""
    current = stage.spec.wire()
    body = {**stable_spec, "replicas": current["replicas"]}
    body.pop("abort", None)
    if "abort" in current:
        body["abort"] = current["abort"]
    try:
        return dataclasses.replace(stage, spec=StageSpec.model_validate(body))
    except (ValidationError, ValueError):
        return None  # a spec this operator no longer accepts: nothing to roll back to


def _failure(pods: Mapping[int, PodView], revision: str, records: Mapping[int, Mapping[str, Any]],
             since: float) -> str | None:
    """Why the revision's own pods show it cannot work: exit 2, or a failure after a restart in this rollout."""
    for pod in pods.values():
        f = pod.failure
        if pod.template_hash != revision or f is None or f.disruption or pod.terminating:
            continue
        words = f"{pod.name}: {f.reason}" + (f" (exit code {f.exit_code})" if f.exit_code is not None else "") \
            + (f": {f.message}" if f.message else "")
        if f.exit_code == INVALID_CONFIG_EXIT:
            return words
        restarted = [t for t in (records.get(pod.index) or {}).get("recentRestarts") or () if parse_time(t) >= since]
        if restarted:
            return f"{words} (crash loop: failed again after {len(restarted)} restart(s))"
    return None


def _history(revisions: list[dict[str, Any]], revision: str, **fields: Any) -> list[dict[str, Any]]:
    return [{**r, **fields} if r["revision"] == revision else r for r in revisions]


def decide(stage: Stage, pods: Mapping[int, PodView], desired: int, now: float,
           image_volumes: bool = False) -> Target:
    spec = stage.spec
    spec_hash = template_hash(stage, image_volumes)
    prev = copy.deepcopy(dict(stage.status.get("rollout") or {}))
    new = copy.deepcopy(prev)
    stable, stable_spec, failed = prev.get("stableRevision"), prev.get("stableSpec"), prev.get("failedRevision")
    revisions = list(prev.get("revisions") or [])
    if not any(r.get("revision") == spec_hash for r in revisions):
        revisions = [*revisions, {"revision": spec_hash, "digest": spec_digest(spec), "generation": stage.generation}]
    new["revisions"] = revisions[-HISTORY:]
    stamp = format_time(now)

    back = _template_stage(stage, stable_spec) if stable_spec and stable and stable != spec_hash else None
    if back is not None and failed and failed.get("revision") == spec_hash:  # rolled back: stay there
        desired_hash = template_hash(back, image_volumes)
        new["currentRevision"] = desired_hash
        return Target(back, desired_hash, new, ("RolloutFailed", _failed_message(failed, stable)))

    live = [p for p in pods.values() if not p.terminating]
    updated_ready = sum(1 for p in live if p.available and p.template_hash == spec_hash)
    complete = len(live) == desired and updated_ready == desired
    if complete or stable == spec_hash:
        if complete and stable != spec_hash:
            new.update(stableRevision=spec_hash, stableSpec=spec.wire())
            new["revisions"] = _history(new["revisions"], spec_hash, readyTime=stamp)
        new["currentRevision"] = spec_hash
        new.pop("progressTime", None)
        new.pop("updatedReady", None)
        return Target(stage, spec_hash, new)

    if prev.get("currentRevision") != spec_hash or "progressTime" not in prev:  # a rollout starts
        new.update(currentRevision=spec_hash, progressTime=stamp, updatedReady=updated_ready)
    elif updated_ready > int(prev.get("updatedReady") or 0):  # progress: a new replica is ready
        new.update(progressTime=stamp, updatedReady=updated_ready)
    if back is None:  # the first revision (or nothing valid to go back to): the restart policy alone
        return Target(stage, spec_hash, new)
    since = parse_time(new["progressTime"])
    deadline = spec.rollout.progress_deadline_seconds or spec.startup_timeout_seconds + 60
    records = {int(r["index"]): r for r in stage.status.get("replicaStatuses") or ()}
    why = _failure(pods, spec_hash, records, since)
    if why is None and now >= since + deadline:
        why = (f"no new replica became ready within progressDeadlineSeconds={deadline} "
               f"({updated_ready}/{desired} updated and ready)")
    if why is None:
        return Target(stage, spec_hash, new, requeue_after=since + deadline - now)
    failed = {"revision": spec_hash, "reason": "RolloutFailed", "message": why, "time": stamp}
    new["failedRevision"] = failed
    new["revisions"] = _history(new["revisions"], spec_hash, failed=why)
    new.pop("progressTime", None)
    new.pop("updatedReady", None)
    desired_hash = template_hash(back, image_volumes)
    new["currentRevision"] = desired_hash
    return Target(back, desired_hash, new, ("RolloutFailed", _failed_message(failed, stable)),
                  [("Normal", "RolledBack", f"rolling back from revision {spec_hash} to {stable}: {why}")])


def _failed_message(failed: Mapping[str, Any], stable: str) -> str:
    return (f"revision {failed['revision']} failed: {failed.get('message', '')}; serving revision {stable} again "
            f"(a spec change starts a new rollout)")
