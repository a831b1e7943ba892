"""What the operator read from the cluster, as plain views the pure reconcile works on."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
import re

from stage_operator.api.meta import (ANNOTATION_DRAIN_REASON, ANNOTATION_DRAINING, HTTP_PORT, LABEL_REPLICA,
                                     LABEL_SERVING, LABEL_TEMPLATE_HASH)
from stage_operator.clock import parse_time

if TYPE_CHECKING:
    from stage_operator.health import PodHealth

_REASON_LINE = re.compile(r"^(?P<reason>[A-Z][A-Za-z0-9]+): (?P<message>.+)$", re.MULTILINE)


@dataclass(frozen=True)
class Failure:
    reason: str
    message: str
    exit_code: int | None
    time: str | None
    disruption: bool = False  # evicted or preempted (DisruptionTarget, reason Evicted): not the stage's fault


@dataclass(frozen=True)
class PodView:
    name: str
    index: int
    phase: str
    ready: bool
    template_hash: str | None
    terminating: bool
    unschedulable: str | None  # the scheduler's message while Pending/Unschedulable
    failure: Failure | None  # set once the pod is Failed
    restarts: int
    uid: str = ""
    serving: bool = True  # the Service selects it (label diffstage.io/serving=true)
    draining_since: float | None = None  # fenced by the drain at this time (annotation)
    drain_reason: str = "ScaleDown"  # why the drain fenced it (annotation): ScaleDown, Outdated, StageDeleted
    pod_ip: str | None = None
    init_running: str | None = None  # the init container running now (fetch-model, copy-model, make-model)
    init_seconds: Mapping[str, float] = field(default_factory=dict)  # finished init containers: how long each took
    gated: tuple[str, ...] = ()  # scheduling gates holding the pending pod (Kueue's admission, a quota controller)

    @property
    def available(self) -> bool:
        return self.ready and not self.terminating

    @property
    def running(self) -> bool:
        """A live container the operator can talk to (not Pending, not Failed or Succeeded, not going)."""
        return self.phase == "Running" and not self.terminating

    @property
    def endpoint(self) -> str | None:
        """Base URL of the stage's HTTP port at the pod IP (None until the kubelet reports one)."""
        if not self.pod_ip:
            return None
        host = f"[{self.pod_ip}]" if ":" in self.pod_ip else self.pod_ip  # IPv6
        return f"http://{host}:{HTTP_PORT}"


def _condition(status: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    return next((c for c in status.get("conditions") or () if c.get("type") == kind), None)


def _disruption(status: Mapping[str, Any]) -> Failure | None:
    """An eviction (kubelet pressure: reason Evicted) or a disruption the cluster announced (condition
    DisruptionTarget: the eviction API, preemption, a taint): the pod is replaced, never counted as a crash."""
    target = _condition(status, "DisruptionTarget")
    if status.get("reason") == "Evicted" or (target and target.get("status") == "True"):
        reason = status.get("reason") or (target or {}).get("reason") or "Evicted"
        message = status.get("message") or (target or {}).get("message") or ""
        return Failure(reason, message, None, (target or {}).get("lastTransitionTime"), disruption=True)
    return None


def _failure(status: Mapping[str, Any]) -> Failure | None:
    if status.get("phase") != "Failed":
        return None
    if evicted := _disruption(status):
        return evicted
    failed_init = [cs for cs in status.get("initContainerStatuses") or ()
                   if ((cs.get("state") or {}).get("terminated") or {}).get("exitCode", 0) != 0]
    for cs in failed_init + list(status.get("containerStatuses") or ()):  # a failed init container: its words
        term = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")
        if term:
            message = (term.get("message") or "").strip()
            reason = term.get("reason") or "Error"
            if line := _REASON_LINE.match(message):  # the stage's own `Reason: message` termination line
                reason, message = line["reason"], line["message"]
            return Failure(reason, message, term.get("exitCode"), term.get("finishedAt"))
    return Failure(status.get("reason") or "Failed", status.get("message") or "", None, None)


def pod_view(pod: Mapping[str, Any]) -> PodView | None:
    """None for a pod that is not one of our replicas (no replica label)."""
    meta, status = pod["metadata"], pod.get("status") or {}
    labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    if not str(labels.get(LABEL_REPLICA, "")).isdigit():
        return None
    ready = _condition(status, "Ready")
    scheduled = _condition(status, "PodScheduled")
    unschedulable = None
    if status.get("phase", "Pending") == "Pending" and scheduled and scheduled.get("status") == "False" \
            and scheduled.get("reason") == "Unschedulable":
        unschedulable = scheduled.get("message") or "Unschedulable"
    return PodView(
        name=meta["name"], index=int(labels[LABEL_REPLICA]), phase=status.get("phase", "Pending"),
        ready=bool(ready and ready.get("status") == "True"), template_hash=labels.get(LABEL_TEMPLATE_HASH),
        terminating=bool(meta.get("deletionTimestamp")), unschedulable=unschedulable, failure=_failure(status),
        restarts=sum(int(cs.get("restartCount") or 0) for cs in status.get("containerStatuses") or ()),
        uid=meta.get("uid") or "", serving=labels.get(LABEL_SERVING) == "true",
        draining_since=_time(annotations.get(ANNOTATION_DRAINING)), pod_ip=status.get("podIP"),
        drain_reason=str(annotations.get(ANNOTATION_DRAIN_REASON) or "ScaleDown"),
        gated=_gates(pod, scheduled), **_init_containers(status))


def _gates(pod: Mapping[str, Any], scheduled: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The gate names while the pod waits for them (spec.schedulingGates, or the scheduler's SchedulingGated)."""
    if (pod.get("status") or {}).get("phase", "Pending") != "Pending":
        return ()
    gates = tuple(str(g.get("name")) for g in (pod.get("spec") or {}).get("schedulingGates") or ())
    if not gates and scheduled and scheduled.get("reason") == "SchedulingGated":
        gates = ("SchedulingGated",)
    return gates


def _init_containers(status: Mapping[str, Any]) -> dict[str, Any]:
    running, seconds = None, {}
    for cs in status.get("initContainerStatuses") or ():
        state = cs.get("state") or {}
        if "running" in state:
            running = cs.get("name")
        term = state.get("terminated") or {}
        started, finished = _time(term.get("startedAt")), _time(term.get("finishedAt"))
        if started is not None and finished is not None:
            seconds[cs.get("name")] = round(max(0.0, finished - started), 3)
    return {"init_running": running, "init_seconds": seconds}


def _time(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return parse_time(text)
    except ValueError:
        return None  # not ours to trust: a hand-edited annotation counts as absent


@dataclass(frozen=True)
class Observed:
    """The stage's children and, when the spec asks for GPUs, the nodes (None: not looked at); what the
    operator's probes saw (by pod uid), the in-flight load over time, and the outcome of an abort it sent."""

    pods: Sequence[Mapping[str, Any]] = ()
    service: Mapping[str, Any] | None = None
    configmap: Mapping[str, Any] | None = None
    pdb: Mapping[str, Any] | None = None  # the stage's PodDisruptionBudget
    network_policy: Mapping[str, Any] | None = None  # the stage's NetworkPolicy
    inference_pool: Mapping[str, Any] | None = None  # the stage's InferencePool (read with spec.routing.inferencePool)
    nodes: Sequence[Mapping[str, Any]] | None = None
    dra: Any = None  # dra.Inventory, read with the nodes when the pods claim devices (podTemplate.resourceClaims)
    # spec.jobs.claimName's PersistentVolumeClaim, or spec.jobs.objectStore.credentialsSecret's Secret (None: not
    # found, or nothing to read: an object store on the service account's identity)
    jobs_claim: Mapping[str, Any] | None = None
    now: str = "1970-01-01T00:00:00Z"  # for lastTransitionTime
    at: float | None = None  # the same moment in epoch seconds (sub-second), for deadlines; default: `now`
    health: Mapping[str, PodHealth] = field(default_factory=dict)
    load_samples: Sequence[tuple[float, int]] = ()  # (time, total in flight), oldest first
    abort: dict[str, Any] | None = None  # the new status.abort when an abort was just sent
    image_volumes: bool = False  # the API server supports image volumes (Kubernetes >= 1.35)
    quota_refused: Mapping[str, str] = field(default_factory=dict)  # pod → why a ResourceQuota refused its creation
    lora_sync: Any = None  # lora_sync.LoraSync when spec.loras were just synced onto the replicas

    @property
    def epoch(self) -> float:
        return self.at if self.at is not None else parse_time(self.now)

    def pod_views(self) -> dict[int, PodView]:
        views = (pod_view(p) for p in self.pods)
        return {v.index: v for v in sorted((v for v in views if v), key=lambda v: (v.index, v.terminating))}
