"""Per-stage gauges on the operator's /metrics, from the status each reconcile writes (what a dashboard ties
together: replicas desired vs ready, the rollout revision, conditions, restarts, the autoscaler's metric). Labels
`namespace` and `stage` (bounded by the stages the operator serves), plus a few fixed words; a stage's series go
when the operator forgets it (deleted)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from prometheus_client import Gauge

REPLICAS = Gauge("diffstage_operator_stage_replicas", "A stage's replicas by kind: desired (spec.replicas, or the "
                 "operator autoscaler's decision), current, ready, updated, sleeping (ready and asleep, with "
                 "spec.sleep)", ["namespace", "stage", "kind"])
CONDITION = Gauge("diffstage_operator_stage_condition", "1 while the stage's condition is True, else 0",
                  ["namespace", "stage", "type"])
ROLLOUT = Gauge("diffstage_operator_stage_rollout_info", "1 for the stage's current and stable rollout revision "
                "(template hashes); a new revision is a new series", ["namespace", "stage", "current_revision",
                                                                       "stable_revision"])
RESTARTS = Gauge("diffstage_operator_stage_restarts", "Restarts decided for the stage since it was created "
                 "(status.restarts.total)", ["namespace", "stage"])
AUTOSCALING = Gauge("diffstage_operator_stage_autoscaling_metric", "The Operator-mode autoscaler's metric at its "
                    "last decision (status.autoscaling.metricValue), by metric: inflight, cost or jobs",
                    ["namespace", "stage", "metric"])
CONDITIONS = ("Accepted", "Progressing", "Ready", "Degraded", "Stalled", "Compiled")

_lock = threading.Lock()
_series: dict[tuple[str, str], dict[Gauge, set[tuple[str, ...]]]] = {}


def merged(old: Mapping[str, Any], patch: Mapping[str, Any] | None) -> dict[str, Any]:
    """`old` with an RFC 7386 merge patch applied (the status as the API server stores it after the write)."""
    out = dict(old)
    for key, value in (patch or {}).items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def _set(key: tuple[str, str], gauge: Gauge, labels: tuple[str, ...], value: float, seen: dict) -> None:
    gauge.labels(*labels).set(value)
    seen.setdefault(gauge, set()).add(labels)


def publish(namespace: str, stage: str, status: Mapping[str, Any], spec_replicas: int | None) -> None:
    """The stage's gauges from its status; series of label values no longer shown (an old revision) go."""
    key, seen = (namespace, stage), {}
    auto = status.get("autoscaling") or {}
    desired = auto.get("desiredReplicas", spec_replicas)
    for kind, value in (("desired", desired), ("current", status.get("replicas")),
                        ("ready", status.get("readyReplicas")), ("updated", status.get("updatedReplicas")),
                        ("sleeping", status.get("sleepingReplicas"))):
        if value is not None:
            _set(key, REPLICAS, (namespace, stage, kind), float(value), seen)
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or ()}
    for kind in CONDITIONS:
        if kind in conditions:
            _set(key, CONDITION, (namespace, stage, kind), 1.0 if conditions[kind] == "True" else 0.0, seen)
    rollout = status.get("rollout") or {}
    if rollout.get("currentRevision"):
        _set(key, ROLLOUT, (namespace, stage, rollout["currentRevision"], rollout.get("stableRevision") or ""), 1.0,
             seen)
    _set(key, RESTARTS, (namespace, stage), float((status.get("restarts") or {}).get("total") or 0), seen)
    if auto.get("metricValue") is not None:
        _set(key, AUTOSCALING, (namespace, stage, auto.get("metric") or "inflight"), float(auto["metricValue"]), seen)
    with _lock:
        for gauge, labels in (_series.get(key) or {}).items():
            for gone in labels - seen.get(gauge, set()):
                gauge.remove(*gone)
        _series[key] = seen


def forget(namespace: str, stage: str) -> None:
    with _lock:
        for gauge, labels in (_series.pop((namespace, stage), None) or {}).items():
            for gone in labels:
                gauge.remove(*gone)
