"""The fail-closed restart policy per replica (docs/operator.md), pure: which failed pods to fence, when to
recreate them, and when to stop.

A replica fails when its pod is Failed (the stage exited: exit code and `Reason: message` from the
termination message) or when the operator's probe finds it unhealthy (`/health` 503, or
`healthCheck.failureThreshold` probes in a row without an answer once it had answered). Then:
fence (label serving=false: out of the Service) → lastFailure → Event → recreate once `backoffUntil`
(initial·2ⁿ, capped; n = restarts inside the window) has passed → when the restarts inside
`windowSeconds` reach `maxRestarts`: stop, keep the failed pod, Stalled/RestartBudgetExhausted (sticky).
Exit code 2 is a configuration error: Stalled/InvalidConfiguration at once, never restarted. An evicted or
preempted pod (reason Evicted, condition DisruptionTarget) is replaced at once, without backoff and without
counting against the budget; its lastFailure says why. Pending pods are never restarted; outdated or
draining pods are the rollout's and the drain's.

The budget (`recentRestarts` and `budgetExhausted`) resets only when something that can change the outcome
changes: the pod template the pods are built from (the desired template hash against `status.templateHash`)
or the restart policy itself (its digest against `status.restarts.policyDigest`). Not a new generation
alone: `kubectl scale` or an HPA writing `/scale`, the operator's autoscaler, a `spec.abort` or new
autoscaling bounds never un-stall a crash-looping stage. The `restarts` counts are not part of the budget.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stage_operator.api.spec import RestartPolicy
from stage_operator.clock import format_time, parse_time
from stage_operator.health import PodHealth
from stage_operator.observed import Failure, PodView

INVALID_CONFIG_EXIT = 2


@dataclass(frozen=True)
class ReplicaRecord:
    """What the status keeps per replica index across pods."""

    restarts: int = 0
    recent: tuple[float, ...] = ()  # restart times inside the window
    last_failure: dict[str, Any] | None = None
    backoff_until: float | None = None
    exhausted: bool = False  # sticky until the pod template or the restart policy changes

    def wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"restarts": self.restarts,
                               "recentRestarts": [format_time(t, millis=True) for t in self.recent]}
        if self.last_failure:
            out["lastFailure"] = self.last_failure
        if self.backoff_until is not None:
            out["backoffUntil"] = format_time(self.backoff_until, millis=True)
        if self.exhausted:
            out["budgetExhausted"] = True
        return out


@dataclass
class Restarts:
    records: dict[int, ReplicaRecord] = field(default_factory=dict)
    fence: list[str] = field(default_factory=list)  # pod names to take out of the Service
    recreate: list[tuple[int, str]] = field(default_factory=list)  # (index, failed pod) to delete and create
    failing: set[int] = field(default_factory=set)  # indices whose pod has failed (kept or being replaced)
    added: int = 0  # restarts decided now (status.restarts.total grows by this)
    stalled: tuple[str, str] | None = None  # (reason, message)
    events: list[tuple[str, str, str]] = field(default_factory=list)
    requeue_after: float | None = None
    policy_digest: str | None = None  # what the budget is counted under: status.restarts.policyDigest


def policy_digest(policy: RestartPolicy) -> str:
    """sha256 of the effective restart policy (first 16 hex digits): any change to it resets the budget."""
    return hashlib.sha256(json.dumps(policy.wire(), sort_keys=True).encode()).hexdigest()[:16]


def same_budget(status: Mapping[str, Any], policy: RestartPolicy, desired_hash: str | None) -> bool:
    """Whether the last status counted the budget under this pod template and this restart policy. A status
    written before the policy digest was recorded counts as the same policy (an upgrade un-stalls nothing)."""
    recorded = (status.get("restarts") or {}).get("policyDigest")
    return status.get("templateHash") == desired_hash and recorded in (None, policy_digest(policy))


def previous_records(status: Mapping[str, Any], same: bool) -> dict[int, ReplicaRecord]:
    """Per index from the last status; not `same` budget: the window is emptied and the stop lifted."""
    out = {}
    for r in status.get("replicaStatuses") or ():
        recent = tuple(parse_time(t) for t in r.get("recentRestarts") or ()) if same else ()
        until = r.get("backoffUntil")
        out[int(r["index"])] = ReplicaRecord(int(r.get("restarts", 0)), recent, r.get("lastFailure"),
                                             parse_time(until) if until else None,
                                             bool(r.get("budgetExhausted")) and same)
    return out


def failure_of(pod: PodView, health: PodHealth | None, threshold: int) -> Failure | None:
    if pod.failure is not None:
        return pod.failure
    if health is None or not pod.running:
        return None
    why = health.failed(threshold, pod.ready)
    if why is None:
        return None
    reason = "Unhealthy" if health.health == "Unhealthy" else "ProbeFailed"
    return Failure(reason, why, None, format_time(health.checked_at))


def _recorded(wire: Mapping[str, Any]) -> Failure:
    return Failure(wire.get("reason", "Failed"), wire.get("message", ""), wire.get("exitCode"), wire.get("time"))


def failure_wire(f: Failure) -> dict[str, Any]:
    return {k: v for k, v in (("reason", f.reason), ("message", f.message), ("exitCode", f.exit_code),
                              ("time", f.time)) if v is not None}


def _describe(pod: str, f: Failure) -> str:
    code = f" (exit code {f.exit_code})" if f.exit_code is not None else ""
    return f"{pod}: {f.reason}{code}" + (f": {f.message}" if f.message else "")


def decide(policy: RestartPolicy, status: Mapping[str, Any], pods: Mapping[int, PodView],
           health: Mapping[str, PodHealth], threshold: int, desired_hash: str | None, now: float) -> Restarts:
    out = Restarts(policy_digest=policy_digest(policy))
    previous = previous_records(status, same_budget(status, policy, desired_hash))
    stalls: list[tuple[str, str]] = []
    for index, pod in sorted(pods.items()):
        prev = previous.get(index, ReplicaRecord())
        recent = tuple(t for t in prev.recent if now - t < policy.window_seconds)
        record = ReplicaRecord(prev.restarts, recent, prev.last_failure)
        failure = None
        if not pod.terminating and pod.draining_since is None and pod.template_hash == desired_hash:
            failure = failure_of(pod, health.get(pod.uid), threshold)
            if failure is None and prev.backoff_until is not None and not pod.serving and prev.last_failure:
                failure = _recorded(prev.last_failure)  # fail-closed: a fenced pod that answers again still goes
        if failure is None:
            out.records[index] = record
            continue
        out.failing.add(index)
        record = ReplicaRecord(record.restarts, recent, failure_wire(failure))
        what = _describe(pod.name, failure)
        if failure.disruption:  # evicted or preempted: not the stage's fault, so no backoff and no budget
            out.recreate.append((index, pod.name))
            out.events.append(("Normal", "ReplicaEvicted", f"{what}; replaced at once "
                               "(not counted against the restart budget)"))
            out.records[index] = record
            continue
        if failure.exit_code == INVALID_CONFIG_EXIT:
            stalls.append(("InvalidConfiguration", f"{what} (a configuration error: not restarted)"))
        elif prev.exhausted or (len(recent) >= policy.max_restarts and prev.backoff_until is None):
            record = ReplicaRecord(record.restarts, recent, record.last_failure, exhausted=True)
            stalls.append(("RestartBudgetExhausted",
                           f"{pod.name} restarted {record.restarts} times, {len(recent)} within "
                           f"{policy.window_seconds}s "
                           f"(maxRestarts {policy.max_restarts}); last failure {what}; the failed pod is kept"))
        else:
            if prev.backoff_until is None:  # first seen now: start the backoff
                delay = min(policy.backoff_max_seconds, policy.backoff_initial_seconds * 2 ** len(recent))
                until = now + delay
                out.events.append(("Warning", "RestartBackoff", f"{what}; restarting in {delay}s "
                                   f"(restart {len(recent) + 1} of {policy.max_restarts} "
                                   f"within {policy.window_seconds}s)"))
            else:
                until = prev.backoff_until
            if now >= until:
                record = ReplicaRecord(record.restarts + 1, (*recent, now), record.last_failure)
                out.recreate.append((index, pod.name))
                out.added += 1
                out.events.append(("Normal", "RestartingReplica",
                                   f"recreating {pod.name} after {failure.reason} (restart {record.restarts})"))
                out.records[index] = record
                continue
            record = ReplicaRecord(record.restarts, recent, record.last_failure, until)
            wait = until - now
            out.requeue_after = wait if out.requeue_after is None else min(out.requeue_after, wait)
        out.records[index] = record
        if pod.serving:
            out.fence.append(pod.name)
    if stalls:
        out.stalled = (stalls[0][0], "; ".join(m for _, m in stalls))
    return out
