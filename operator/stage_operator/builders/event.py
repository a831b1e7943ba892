"""Kubernetes Events for the operator's decisions (pods created or deleted, a condition turning bad)."""

from __future__ import annotations

from typing import Any

from stage_operator.api.meta import API_VERSION, KIND, MANAGED_BY
from stage_operator.stage import Stage


def build_event(stage: Stage, kind: str, reason: str, message: str, now: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{stage.name}.", "namespace": stage.namespace},
            "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": stage.name,
                               "namespace": stage.namespace, "uid": stage.uid},
            "type": kind, "reason": reason, "message": message[:1024], "count": 1,
            "firstTimestamp": now, "lastTimestamp": now, "source": {"component": MANAGED_BY},
            "reportingComponent": MANAGED_BY}
