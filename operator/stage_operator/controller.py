"""One reconcile of one stage: read (kube) → act on the stage contract where the spec asks (abort) → reconcile
(pure) → apply (kube), one status write at most. Also the operator's memory of each stage: what its probes
saw (`HealthBook`), the in-flight load over time (autoscaling), the pods to probe, aborts already sent."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from stage_operator import autoscale, lora_sync, metrics, stage_gauges, stage_http
from stage_operator.clock import format_time
from stage_operator.health import HealthBook
from stage_operator.kube import ApiError, Kube
from stage_operator.observed import Observed
from stage_operator.plan import Plan
from stage_operator.reconcile import needs_nodes, reconcile
from stage_operator.stage import Stage, parse_stage

log = logging.getLogger(__name__)
MAX_SAMPLES = 100_000
QUOTA_RETRY_SECONDS = 5.0  # a pod a ResourceQuota refused is tried again this often
LORA_RETRY_SECONDS = 2.0  # an adapter still in use, a replica not answering: the LoRA sync looks again


def utc_now() -> str:
    return format_time(time.time())


@dataclasses.dataclass
class Targets:
    """What the prober of one stage polls: set by each reconcile."""

    period: float
    timeout: float
    autoscaling: bool  # record the load (operator autoscaling)
    window: float  # how much load history autoscaling needs
    metric: str  # what the load is: inflight (requests), cost (outstanding pixel-steps) or jobs (the store backlog)
    pods: dict[str, tuple[str, str, bool]]  # uid -> (pod, base url, active: serving and not draining)
    api_key: str | None = None  # spec.auth: the Bearer key for /v1/stats


@dataclasses.dataclass
class StageMemory:
    health: HealthBook = dataclasses.field(default_factory=HealthBook)
    samples: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=MAX_SAMPLES))
    targets: Targets | None = None
    aborts: dict[tuple[str, str], dict[str, Any]] = dataclasses.field(default_factory=dict)
    api_key: str | None = None  # read from spec.auth.secretRef at each reconcile (a rotated key follows)
    quota_refused: dict[str, str] = dataclasses.field(default_factory=dict)  # pods the last apply could not create
    metric: str = "inflight"  # what `samples` measure: a new autoscaling.metric starts a new history

    def record_load(self, at: float, demand: int, window: float, metric: str = "inflight") -> None:
        if metric != self.metric:
            self.samples.clear()
            self.metric = metric
        self.samples.append((at, demand))
        while len(self.samples) > 1 and self.samples[1][0] <= at - window:  # keep one sample from before
            self.samples.popleft()


class Controller:
    def __init__(self, kube: Kube, clock: Callable[[], float] = time.time):
        self.kube, self.clock = kube, clock
        self.memory: dict[tuple[str, str], StageMemory] = {}
        self._session: aiohttp.ClientSession | None = None
        # one reconcile of a stage at a time: at deletion the stopping worker's last one may still run when
        # kopf calls the deletion handler
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    def remember(self, namespace: str, name: str) -> StageMemory:
        return self.memory.setdefault((namespace, name), StageMemory())

    def forget(self, namespace: str, name: str) -> None:
        self.memory.pop((namespace, name), None)
        stage_gauges.forget(namespace, name)
        if (lock := self._locks.get((namespace, name))) is not None and not lock.locked():
            del self._locks[(namespace, name)]

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    # -- the synchronous path (benchmarks, no pods to talk to) ---------------------------------------------
    def read(self, namespace: str, name: str, at: float) -> tuple[Stage, Observed] | None:
        body = self.kube.read_stage(namespace, name)
        if body is None:
            return None
        stage = parse_stage(body)
        observed = self.kube.observe(stage, nodes=None, now=format_time(at))
        if needs_nodes(stage, observed):
            observed = dataclasses.replace(observed, nodes=self.kube.list_nodes())
            if stage.spec.pod_template.resource_claims:
                observed = dataclasses.replace(observed, dra=self.kube.read_dra(
                    stage.namespace, stage.spec.pod_template.resource_claims))
        if stage.spec is not None and stage.spec.model.source is not None and stage.spec.model.source.image \
                and stage.spec.model.image_volume == "auto":
            observed = dataclasses.replace(observed, image_volumes=self.kube.image_volumes())
        return stage, dataclasses.replace(observed, at=at)

    def apply(self, stage: Stage, plan: Plan) -> None:
        self.remember(stage.namespace, stage.name).quota_refused = self.kube.apply(stage, plan) or {}
        for event in plan.events:
            if event["reason"] == "RestartingReplica":
                metrics.RESTARTS.inc()
            elif event["reason"] in ("ScaledUp", "ScaledDown"):
                metrics.AUTOSCALING_DECISIONS.labels(direction=event["reason"]).inc()
            elif event["reason"] == "Aborted":
                metrics.ABORTS.inc()

    def reconcile_once(self, namespace: str, name: str) -> Plan | None:
        """The applied plan; None when the stage no longer exists."""
        with metrics.RECONCILE_SECONDS.time():
            read = self.read(namespace, name, self.clock())
            if read is None:
                return None
            stage, observed = read
            plan = reconcile(stage, self._with_memory(stage, observed))
            self.apply(stage, plan)
        self._done(stage, observed, plan)
        return plan

    # -- the operator's path: the same, plus what needs the pods' HTTP ---------------------------------------
    async def run(self, namespace: str, name: str) -> Plan | None:
        async with self._locks.setdefault((namespace, name), asyncio.Lock()):
            return await self._run(namespace, name)

    async def _run(self, namespace: str, name: str) -> Plan | None:
        started = time.perf_counter()
        read = await asyncio.to_thread(self.read, namespace, name, self.clock())
        if read is None:
            self.forget(namespace, name)
            return None
        stage, observed = read
        observed = self._with_memory(stage, observed)
        self.remember(namespace, name).api_key = await asyncio.to_thread(self._api_key, stage)
        if (spec_abort := self._pending_abort(stage)) is not None:
            observed = dataclasses.replace(observed, abort=await self._abort(stage, observed, spec_abort))
        if (synced := await self._sync_loras(stage, observed)) is not None:
            observed = dataclasses.replace(observed, lora_sync=synced)
        plan = reconcile(stage, observed)
        if synced is not None and synced.pending:          # an adapter in use, a replica unreachable: look again
            plan = dataclasses.replace(plan, requeue_after=min(plan.requeue_after or LORA_RETRY_SECONDS,
                                                               LORA_RETRY_SECONDS))
        await asyncio.to_thread(self.apply, stage, plan)
        if self.remember(namespace, name).quota_refused:  # look again soon: status says why, quota may free up
            plan = dataclasses.replace(plan, requeue_after=min(plan.requeue_after or QUOTA_RETRY_SECONDS,
                                                               QUOTA_RETRY_SECONDS))
        metrics.RECONCILE_SECONDS.observe(time.perf_counter() - started)
        self._done(stage, observed, plan)
        return plan

    def _api_key(self, stage: Stage) -> str | None:
        """The key the stage wants on /v1/* (spec.auth.secretRef), read through the API each reconcile, also while
        the stage is deleted (its drain reads the pods' load); None without auth, or when the Secret cannot be read
        (said in the log: the probes then get 401)."""
        if stage.spec is None or stage.spec.auth is None:
            return None
        ref = stage.spec.auth.secret_ref
        try:
            key = self.kube.read_api_key(stage.namespace, ref.name, ref.key)
        except ApiError as exc:  # 403: the operator was not granted `get` on secrets in this namespace
            log.warning("stage %s/%s: cannot read spec.auth.secretRef %s: %s", stage.namespace, stage.name,
                        ref.name, exc)
            return None
        if key is None:
            log.warning("stage %s/%s: Secret %s has no key %r with an API key in it", stage.namespace,
                        stage.name, ref.name, ref.key)
        return key

    def _with_memory(self, stage: Stage, observed: Observed) -> Observed:
        memory = self.remember(stage.namespace, stage.name)
        samples = tuple(memory.samples) if stage.spec is None or memory.metric == autoscale.metric_of(stage.spec) \
            else ()  # measured in another unit than the spec's metric asks: none yet
        return dataclasses.replace(observed, health=memory.health.snapshot(), load_samples=samples,
                                   quota_refused=dict(memory.quota_refused))

    def _done(self, stage: Stage, observed: Observed, plan: Plan) -> None:
        metrics.RECONCILES.labels(result="changed" if plan.writes else "unchanged").inc()
        if plan.writes:
            log.info("stage %s/%s: %s", stage.namespace, stage.name, plan.summary())
        stage_gauges.publish(stage.namespace, stage.name, stage_gauges.merged(stage.status, plan.status),
                             stage.spec.replicas if stage.spec is not None else None)
        self._publish_targets(stage, observed)

    def _publish_targets(self, stage: Stage, observed: Observed) -> None:
        memory = self.remember(stage.namespace, stage.name)
        if stage.spec is None:  # a deleted stage's pods are still probed: the drain waits for them
            memory.targets = None
            return
        pods = {}
        for pod in observed.pod_views().values():
            url = pod.endpoint
            if pod.running and url and pod.uid:
                pods[pod.uid] = (pod.name, url, pod.serving and pod.draining_since is None)
        spec = stage.spec
        a = spec.autoscaling
        window = max(a.scale_up_stabilization_seconds or 0, a.scale_down_stabilization_seconds or 300)
        memory.targets = Targets(spec.health_check.period_seconds, spec.health_check.timeout_seconds,
                                 a.mode == "Operator" and not stage.deleting,  # no load to record while it drains
                                 window + 2 * spec.health_check.period_seconds, autoscale.metric_of(spec), pods,
                                 memory.api_key)

    # -- spec.loras, live on every ready replica (lora_sync) ---------------------------------------------------
    async def _sync_loras(self, stage: Stage, observed: Observed) -> lora_sync.LoraSync | None:
        """None when nothing needs a look (the usual case: no HTTP call at all)."""
        if stage.spec is None or stage.deleting:
            return None
        want, applied = lora_sync.wanted(stage.spec.loras), lora_sync.applied(stage.status, stage.spec.loras)
        ready = [p for p in observed.pod_views().values() if p.available and p.endpoint and not p.terminating]
        listed = {p.name: (h.loras if (h := observed.health.get(p.uid)) is not None else None) for p in ready}
        if not lora_sync.needs_sync(want, applied, listed):
            return None
        return await lora_sync.sync(self.session, [(p.name, p.endpoint) for p in ready], want, applied,
                                    stage.spec.health_check.timeout_seconds * 5, self.remember(
                                        stage.namespace, stage.name).api_key)

    # -- abort: a new spec.abort.id, sent once ----------------------------------------------------------------
    @staticmethod
    def _pending_abort(stage: Stage) -> Any:
        spec_abort = stage.spec.abort if stage.spec is not None and not stage.deleting else None
        if spec_abort is None or (stage.status.get("abort") or {}).get("observedId") == spec_abort.id:
            return None
        return spec_abort

    async def _abort(self, stage: Stage, observed: Observed, spec_abort: Any) -> dict[str, Any]:
        memory = self.remember(stage.namespace, stage.name)
        key = (stage.uid, spec_abort.id)
        if key not in memory.aborts:  # sent once even when the status write that records it fails
            targets = [(p.name, p.endpoint) for p in observed.pod_views().values()
                       if p.running]
            ids = None if spec_abort.all else list(spec_abort.request_ids or ())
            result = await stage_http.abort(self.session, targets, ids, stage.spec.health_check.timeout_seconds,
                                            memory.api_key)
            memory.aborts[key] = {"observedId": spec_abort.id, **result,
                                  "completedTime": format_time(self.clock())}
            log.info("stage %s/%s: abort %s: %s", stage.namespace, stage.name, spec_abort.id, result)
        return memory.aborts[key]

    # -- the prober: one round over a stage's pods -------------------------------------------------------------
    async def probe_round(self, namespace: str, name: str) -> tuple[bool, float]:
        """Probe every published pod once; (whether anything the status or autoscaling uses changed, the
        seconds until the next round)."""
        memory = self.remember(namespace, name)
        targets = memory.targets
        if targets is None:
            return False, 0.5
        items = list(targets.pods.items())
        results = await asyncio.gather(*(stage_http.probe(self.session, url, targets.timeout, targets.api_key)
                                         for _, (_, url, _) in items))
        changed, answered, at = False, [], self.clock()
        for (uid, (pod, _, active)), result in zip(items, results, strict=True):
            health, moved = memory.health.record(uid, result)
            changed |= moved
            if result.error is not None or result.dead is not None:
                metrics.PROBE_FAILURES.labels(kind="unhealthy" if result.dead else "unreachable").inc()
                log.debug("probe %s/%s: %s", namespace, pod, result.dead or result.error)
            if active and result.error is None and health.in_flight is not None:
                answered.append(health)
        memory.health.forget_except(set(targets.pods))
        if targets.autoscaling and answered:  # no answer is no measurement (never a reason to scale down)
            memory.record_load(at, autoscale.demand(answered, targets.metric), targets.window, targets.metric)
            changed = True  # the stabilization windows move with time: let the reconcile look
        return changed, targets.period
