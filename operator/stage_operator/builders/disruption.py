"""The stage's PodDisruptionBudget (pure): voluntary disruptions (a node drain, the eviction API) may take at
most `disruption.maxUnavailable` serving replicas at once. Default 1 when the stage has 2 replicas or more;
with fewer, none unless `disruption.maxUnavailable` asks for one (a budget on a single replica would block
every node drain). The Kubernetes disruption controller reads the expected count through the stage's
`/scale` subresource (the pods' controller ownerReference)."""

from __future__ import annotations

from typing import Any

from stage_operator.api.meta import serving_selector
from stage_operator.builders.children import owned_metadata
from stage_operator.stage import Stage


def pdb_name(stage: Stage) -> str:
    return stage.name


def max_unavailable(stage: Stage, replicas: int) -> int | None:
    """The budget for `replicas` serving replicas; None: no PodDisruptionBudget."""
    asked = stage.spec.disruption.max_unavailable
    if asked is not None:
        return asked
    return 1 if replicas >= 2 else None


def build_pdb(stage: Stage, replicas: int) -> dict[str, Any] | None:
    budget = max_unavailable(stage, replicas)
    if budget is None:
        return None
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": owned_metadata(stage, pdb_name(stage)),
            "spec": {"maxUnavailable": budget, "selector": {"matchLabels": serving_selector(stage.name)},
                     "unhealthyPodEvictionPolicy": "AlwaysAllow"}}
