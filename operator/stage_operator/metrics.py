"""Operator metrics on /metrics (prometheus_client): reconciles by outcome, their duration, errors."""

from prometheus_client import Counter, Histogram

RECONCILES = Counter("diffstage_operator_reconciles_total", "Reconciles by outcome (changed: at least one write)",
                     ["result"])
RECONCILE_ERRORS = Counter("diffstage_operator_reconcile_errors_total", "Reconciles that failed on an API error")
RECONCILE_SECONDS = Histogram("diffstage_operator_reconcile_seconds", "Duration of one reconcile (reads, plan, writes)",
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
