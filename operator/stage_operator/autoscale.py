"""Operator-driven autoscaling, pure: desired replicas = ceil(demand / target per replica) within
[min, max] (demand, `autoscaling.metric` inflight: the requests in flight on the serving replicas plus the video
jobs queued in the stage's job store, which no replica holds yet; cost: the outstanding pixel-steps the serving
replicas report, so one 1024² 50-step request weighs what 60 small ones do; jobs: the video jobs queued + in
progress in the job store, store-wide and so counted once), stabilized with separate windows (HPA's rule, made
strict): scale up to the smallest recommendation seen over the whole up window, down to the largest seen over the
whole down window; a window that the samples do not yet cover changes nothing. The operator records the decision in
`status.autoscaling` and never writes `spec`."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stage_operator.api.spec import StageSpec
from stage_operator.clock import format_time
from stage_operator.health import PodHealth

Sample = tuple[float, int]  # (time, demand over the active replicas: in flight + queued video jobs, cost, or jobs)
WORDS = {"inflight": "in-flight", "cost": "outstanding pixel-steps", "jobs": "video jobs queued + in progress"}


def metric_of(spec: StageSpec) -> str:
    return spec.autoscaling.metric or "inflight"


def demand(answered: Sequence[PodHealth], metric: str = "inflight") -> int:
    """The load to scale on, from the probes of the serving replicas that answered. inflight: their requests in
    flight (a running video job is one of them), plus the video jobs queued in the shared store, counted once (every
    replica counts the same store; the largest count is the newest). cost: their outstanding pixel-steps (a stage
    too old to report it counts 0). jobs: the store's jobs queued + in progress, taken once: every replica reports
    the same store-wide counts (as of its last scan), so the largest is used, never the sum; a replica that reports
    no job counts (no store) adds nothing."""
    if metric == "cost":
        return sum(h.cost or 0 for h in answered)
    if metric == "jobs":
        return max((store_backlog(h.jobs) for h in answered if h.jobs is not None), default=0)
    in_flight = sum(h.in_flight or 0 for h in answered)
    return in_flight + max((int((h.jobs or {}).get("queued") or 0) for h in answered), default=0)


def store_backlog(jobs: Mapping[str, Any]) -> int:
    """The job store's work not finished: its jobs queued + in progress (one replica's /v1/stats jobs)."""
    return int(jobs.get("queued") or 0) + int(jobs.get("in_progress") or 0)


@dataclass(frozen=True)
class Policy:
    low: int
    high: int
    target: int
    up_window: float
    down_window: float
    metric: str = "inflight"

    @classmethod
    def of(cls, spec: StageSpec) -> Policy:
        a = spec.autoscaling
        high = a.max_replicas if a.max_replicas is not None else max(spec.replicas, 1)
        low = min(a.min_replicas if a.min_replicas is not None else 1, high)
        metric = metric_of(spec)
        target = {"cost": a.target_cost_per_replica or 1,
                  "jobs": a.target_jobs_per_replica or spec.engine.max_num_seqs,  # the jobs a replica claims at once
                  }.get(metric, a.target_in_flight_per_replica or spec.engine.max_num_seqs)
        return cls(low, high, target,
                   a.scale_up_stabilization_seconds if a.scale_up_stabilization_seconds is not None else 0,
                   a.scale_down_stabilization_seconds if a.scale_down_stabilization_seconds is not None else 300,
                   metric)

    def clamp(self, replicas: int) -> int:
        return max(self.low, min(self.high, replicas))

    def recommend(self, in_flight: int) -> int:
        return self.clamp(math.ceil(in_flight / self.target))


def _window(samples: Sequence[Sample], now: float, seconds: float) -> list[Sample] | None:
    """The samples in force during [now - seconds, now]: those inside plus the last one before (which was in
    force at the window's start); None when no sample is that old (the window is not covered yet)."""
    start = now - seconds
    before = [s for s in samples if s[0] <= start]
    if not before:
        return None
    return [before[-1], *(s for s in samples if start < s[0] <= now)]


def stabilized(current: int, samples: Sequence[Sample], now: float, policy: Policy) -> tuple[int, str]:
    """(desired replicas, why). `samples` oldest first."""
    current = policy.clamp(current)
    if not samples:
        return current, "no load samples yet"
    latest = samples[-1][1]
    up = _window(samples, now, policy.up_window)
    word = WORDS[policy.metric]
    if up is not None and (low := min(policy.recommend(v) for _, v in up)) > current:
        return low, (f"{word} {latest} over target {policy.target} per replica for {policy.up_window:g}s: "
                     f"scale up to {low}")
    down = _window(samples, now, policy.down_window)
    if down is not None and (high := max(policy.recommend(v) for _, v in down)) < current:
        return high, (f"{word} at most {max(v for _, v in down)} for {policy.down_window:g}s (target "
                      f"{policy.target} per replica): scale down to {high}")
    return current, ""


def decide(spec: StageSpec, previous: Mapping[str, Any] | None, samples: Sequence[Sample],
           now: float) -> tuple[int, dict[str, Any] | None, tuple[str, str, str] | None]:
    """(desired replicas, the new status.autoscaling or None when unchanged, an Event or None)."""
    policy = Policy.of(spec)
    start = previous.get("desiredReplicas") if previous else None
    current = policy.clamp(start if start is not None else spec.replicas)
    desired, why = stabilized(current, samples, now, policy)
    metric = float(samples[-1][1]) if samples else None
    if start is None or desired != start:
        reason = why if start is not None else (f"start at {desired} (spec.replicas {spec.replicas} within "
                                                f"[{policy.low}, {policy.high}])")
        status = {"desiredReplicas": desired, "metric": policy.metric, "reason": reason,
                  "lastScaleTime": format_time(now)}
        if metric is not None:
            status["metricValue"] = metric
        event = None
        if start is not None:
            event = ("Normal", "ScaledUp" if desired > start else "ScaledDown", f"{start} → {desired}: {reason}")
        return desired, status, event
    return desired, None, None
