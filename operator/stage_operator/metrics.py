"""Operator metrics on /metrics (prometheus_client): reconciles by outcome, their duration, errors; restarts,
autoscaling decisions, probe failures, aborts."""

from prometheus_client import Counter, Histogram

RECONCILES = Counter("diffstage_operator_reconciles_total", "Reconciles by outcome (changed: at least one write)",
                     ["result"])
RECONCILE_ERRORS = Counter("diffstage_operator_reconcile_errors_total", "Reconciles that failed on an API error")
RECONCILE_SECONDS = Histogram("diffstage_operator_reconcile_seconds", "Duration of one reconcile (reads, plan, writes)",
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
RESTARTS = Counter("diffstage_operator_restarts_total", "Replicas recreated by the fail-closed restart policy")
AUTOSCALING_DECISIONS = Counter("diffstage_operator_autoscaling_decisions_total",
                                "Operator autoscaling decisions that changed the desired replicas", ["direction"])
PROBE_FAILURES = Counter("diffstage_operator_probe_failures_total",
                         "Probes of stage pods that failed (unhealthy: /health 503; unreachable: no answer)", ["kind"])
ABORTS = Counter("diffstage_operator_aborts_total", "spec.abort ids carried out")
