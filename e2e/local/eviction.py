"""The `pods/eviction` subresource as kube-apiserver serves it, honouring PodDisruptionBudgets (policy/v1):
what `kubectl drain` and the cluster autoscaler call. An eviction the budgets allow marks the pod with a
`DisruptionTarget` condition (reason EvictionByEvictionAPI) and deletes it (201); one that would take a
budget below its floor answers 429 TooManyRequests. A pod that is not Ready is always evictable under
`unhealthyPodEvictionPolicy: AlwaysAllow`. Simplification: a budget's expected count is the number of pods its
selector matches (Kubernetes reads the controller's `/scale`)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Obj = dict[str, Any]


def _ready(pod: Obj) -> bool:
    conditions = (pod.get('status') or {}).get('conditions') or ()
    return any(c.get('type') == 'Ready' and c.get('status') == 'True' for c in conditions) \
        and not pod['metadata'].get('deletionTimestamp')


def _selects(pdb: Obj, pod: Obj) -> bool:
    wanted = ((pdb.get('spec') or {}).get('selector') or {}).get('matchLabels') or {}
    labels = pod['metadata'].get('labels') or {}
    return bool(wanted) and all(labels.get(k) == v for k, v in wanted.items())


def disruptions_allowed(pdb: Obj, pods: Iterable[Obj]) -> int:
    spec = pdb.get('spec') or {}
    selected = [p for p in pods if _selects(pdb, p) and not p['metadata'].get('deletionTimestamp')]
    healthy = sum(1 for p in selected if _ready(p))
    if 'minAvailable' in spec:
        floor = int(spec['minAvailable'])
    else:
        floor = len(selected) - int(spec.get('maxUnavailable', 0))
    return healthy - floor


def refusal(pod: Obj, pdbs: Iterable[Obj], pods: list[Obj]) -> str | None:
    """Why the eviction of `pod` is refused, or None: it may go."""
    for pdb in pdbs:
        if not _selects(pdb, pod):
            continue
        unhealthy_ok = (pdb.get('spec') or {}).get('unhealthyPodEvictionPolicy') == 'AlwaysAllow'
        if unhealthy_ok and not _ready(pod):
            continue
        if disruptions_allowed(pdb, pods) <= 0:
            return (f"Cannot evict pod as it would violate the pod's disruption budget "
                    f"{pdb['metadata']['name']}.")
    return None


def disruption_target(at: str) -> Obj:
    return {'type': 'DisruptionTarget', 'status': 'True', 'reason': 'EvictionByEvictionAPI',
            'message': 'Eviction API: evicting', 'lastTransitionTime': at}
