"""kopf wiring, kept thin: one worker (daemon) per stage runs read → reconcile → apply → status whenever a
watch event concerns the stage (its spec, its pods, node capacity), when the last plan's deadline (a restart
backoff, a drain timeout) comes, and on every resync. A second daemon per stage probes its pods
(`healthCheck.periodSeconds`) and wakes the worker when what it saw changed. The event handlers are async on
purpose: they set asyncio Events, which is only safe from the operator's own loop.

Run with `python -m stage_operator` (its flags become `memo.config`, a `settings.OperatorSettings`) or
`kopf run -m stage_operator.handlers` (the default settings).
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from stage_operator import metrics
from stage_operator.api.meta import GROUP, LABEL_STAGE, PLURAL, VERSION
from stage_operator.controller import Controller
from stage_operator.kube import ApiError, Kube
from stage_operator.settings import OperatorSettings
from stage_operator.triggers import Triggers

log = logging.getLogger(__name__)
MAX_ERROR_BACKOFF = 60.0


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = f"{GROUP}/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.WARNING  # Events for warnings only, never for routine logs
    settings.watching.server_timeout = 300  # and a client timeout above it: kopf's known silent-stall trap
    settings.watching.client_timeout = 330
    memo.config = memo.get("config") or OperatorSettings()
    memo.triggers = Triggers()
    memo.controller = Controller(Kube())
    memo.nodes = {}


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10)
async def stage_worker(name: str, namespace: str, memo: kopf.Memo, stopped: kopf.DaemonStopped, **_: Any) -> None:
    trigger, failures = memo.triggers.register(namespace, name), 0
    try:
        while not stopped:
            trigger.clear()
            try:
                plan = await memo.controller.run(namespace, name)
                failures, delay = 0, memo.config.resync_seconds
                if plan is not None and plan.requeue_after is not None:
                    delay = min(delay, plan.requeue_after)
            except ApiError as exc:  # a conflict, a 5xx, a webhook: log it, back off, read everything again
                failures += 1
                delay = min(MAX_ERROR_BACKOFF, 0.5 * 2 ** failures)
                metrics.RECONCILE_ERRORS.inc()
                log.warning("stage %s/%s: reconcile failed (retry in %.1fs): %s", namespace, name, delay, exc)
            await Triggers.wait(trigger, delay, stopped)
    finally:
        memo.triggers.unregister(namespace, name)
        if not (stopped.reason and stopped.reason & kopf.DaemonStoppingReason.RESOURCE_DELETED):
            memo.controller.forget(namespace, name)  # else the deletion handler still drains with this memory


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10)
async def stage_prober(name: str, namespace: str, memo: kopf.Memo, stopped: kopf.DaemonStopped, **_: Any) -> None:
    """Polls the stage's running pods (`/health`, `/v1/stats`); the worker turns what it saw into status,
    restarts and autoscaling decisions."""
    while not stopped:
        changed, delay = await memo.controller.probe_round(namespace, name)
        if changed:
            memo.triggers.fire(namespace, name)
        await stopped.wait(delay)


@kopf.on.delete(GROUP, VERSION, PLURAL)
async def stage_deleted(name: str, namespace: str, memo: kopf.Memo, retry: int, **_: Any) -> None:
    """The stage is being deleted: its pods leave through the drain (fenced, deleted once a probe taken after
    the fence sees nothing in flight); kopf's finalizer holds the stage until then. kopf stops the daemons at
    deletion, so this handler reconciles and probes itself, woken like the worker (pod events, a probe that
    saw a change, the drain's deadline), and returns once every pod has left: one call for a normal deletion,
    never a kopf retry (each would be an ERROR line and a write of retry state into the stage). A real
    failure, an API error, is one: kopf.TemporaryError, logged as an ERROR, retried with backoff."""
    trigger = memo.triggers.register(namespace, name)
    try:
        while True:
            trigger.clear()
            try:
                plan = await memo.controller.run(namespace, name)
            except ApiError as exc:
                metrics.RECONCILE_ERRORS.inc()
                raise kopf.TemporaryError(f"draining {namespace}/{name} failed: {exc}",
                                          delay=min(MAX_ERROR_BACKOFF, 0.5 * 2 ** (retry + 1))) from exc
            if plan is None or (not plan.patch and plan.requeue_after is None):
                break  # every pod has left (or is going without work on it)
            changed, period = await memo.controller.probe_round(namespace, name)
            if not (changed or plan.writes):  # after a write or a change, look again at once
                deadline = plan.requeue_after
                await Triggers.wait(trigger, period if deadline is None else min(period, deadline))
    finally:
        memo.triggers.unregister(namespace, name)
    memo.controller.forget(namespace, name)


@kopf.on.cleanup()
async def close_sessions(memo: kopf.Memo, **_: Any) -> None:
    await memo.controller.close()


@kopf.on.event(GROUP, VERSION, PLURAL)
async def stage_changed(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Spec changes (generation ahead of observedGeneration) and deletions; our own status writes are not."""
    meta, status = body["metadata"], body.get("status") or {}
    if type in (None, "ADDED", "DELETED") or meta.get("generation") != status.get("observedGeneration") \
            or meta.get("deletionTimestamp"):
        memo.triggers.fire(meta["namespace"], meta["name"])
    if type == "DELETED":  # gone: also when its finalizer was removed by hand and no deletion handler ran
        memo.controller.forget(meta["namespace"], meta["name"])


@kopf.on.event("", "v1", "pods", labels={LABEL_STAGE: kopf.PRESENT})
async def pod_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    memo.triggers.fire(body["metadata"]["namespace"], body["metadata"]["labels"][LABEL_STAGE])


@kopf.on.event("", "v1", "nodes")
async def node_changed(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Capacity changed (allocatable, schedulable, a node came or went): every stage re-checks."""
    name = body["metadata"]["name"]
    allocatable = (body.get("status") or {}).get("allocatable") or {}
    schedulable = not (body.get("spec") or {}).get("unschedulable", False)
    summary = None if type == "DELETED" else (dict(allocatable), schedulable)
    if memo.nodes.get(name) != summary:
        memo.nodes[name] = summary
        memo.triggers.fire_all()
