"""One reconcile of one stage: read (kube) → reconcile (pure) → apply (kube), one status write at most."""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections.abc import Callable

from stage_operator import metrics
from stage_operator.kube import Kube
from stage_operator.plan import Plan
from stage_operator.reconcile import needs_nodes, reconcile
from stage_operator.stage import parse_stage

log = logging.getLogger(__name__)


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Controller:
    def __init__(self, kube: Kube, clock: Callable[[], str] = utc_now):
        self.kube, self.clock = kube, clock

    def reconcile_once(self, namespace: str, name: str) -> Plan | None:
        """The applied plan; None when the stage no longer exists."""
        with metrics.RECONCILE_SECONDS.time():
            body = self.kube.read_stage(namespace, name)
            if body is None:
                return None
            stage = parse_stage(body)
            observed = self.kube.observe(stage, nodes=None, now=self.clock())
            if needs_nodes(stage, observed):
                observed = dataclasses.replace(observed, nodes=self.kube.list_nodes())
            plan = reconcile(stage, observed)
            self.kube.apply(stage, plan)
        metrics.RECONCILES.labels(result="changed" if plan.writes else "unchanged").inc()
        if plan.writes:
            log.info("stage %s/%s: %s", namespace, name, plan.summary())
        return plan
