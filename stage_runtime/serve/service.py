"""StageService: what the HTTP and ZMQ frontends share — admission, outcomes, abort, stats, drain.

Every request enters through :meth:`StageService.submit` and is consumed through
:meth:`StageService.outputs`, so its outcome is counted exactly once and a consumer that goes away
(client disconnect, unroutable ZMQ peer) aborts it. Runs on the event loop thread only.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from stage_runtime.config import StageConfig
from stage_runtime.control import check_control_rpc
from stage_runtime.errors import (DiffStageError, EngineClosedError, EngineDeadError, RpcError, StageUnavailableError,
                                  outcome_of)
from stage_runtime.model_info import ModelInfo
from stage_runtime.outputs import DiffusionOutput
from stage_runtime.serve.model_views import compile_view, weights_view
from stage_runtime.serve.metrics import StageMetrics
from stage_runtime.serve.startup import StartupProgress

if TYPE_CHECKING:
    from stage_runtime.engine import DiffusionEngine, RequestStream
    from stage_runtime.request import DiffusionRequest

log = logging.getLogger(__name__)
OFFLOAD_STATS_PERIOD_S = 2.0
OFFLOAD_STATS_TIMEOUT_S = 60.0



class StageService:
    def __init__(self, config: StageConfig, metrics: StageMetrics):
        self.config = config
        self.metrics = metrics
        self.engine: DiffusionEngine | None = None
        self.startup = StartupProgress()            # the phases while starting, their durations after
        self.draining = False
        self._drain_note: str | None = None       # set once the drain timeout expired
        self._active: dict[str, RequestStream] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._exec_s: float | None = None          # moving average of exec time (Retry-After estimate)
        self.offload: list[dict[str, Any]] | None = None   # last offload_stats() per rank (offload on)
        self.compile: list[dict[str, Any]] | None = None   # last compile_stats() per rank (compile on)
        self._offload_task: asyncio.Task | None = None

    def attach(self, engine: DiffusionEngine) -> None:
        """The engine is started and warmed up: the stage becomes ready."""
        engine.observers.add(self.metrics.observe_execute)
        engine.sleep.on_wake.append(self.metrics.sleep.wake_seconds.observe)
        engine.sleep.run_idle_timer()                  # sleep.after_idle_s: the stage sleeps itself when idle
        self.engine = engine
        self.compile = engine.compile_warmup_stats
        polled = [name for name, on in (("offload", self.config.offload.mode != "none"),
                                        ("compile", self.config.compile.enabled)) if on]
        if polled:
            self._offload_task = asyncio.get_running_loop().create_task(self._poll_rank_stats(polled))

    async def _poll_rank_stats(self, names: list[str]) -> None:
        """Every rank's offload accounting and compile report (``<name>_stats``), refreshed in the background:
        ``/v1/stats`` never waits for them.

        The RPC is ordered with the engine's waves (it may wait for a request-mode call to finish), so it
        runs on a thread and the last snapshot is served.
        """
        while self.engine is not None and self.engine.dead_reason is None:
            for name in names:
                try:
                    setattr(self, name, await asyncio.to_thread(self.engine.collective_rpc, f"{name}_stats", (), {},
                                                                OFFLOAD_STATS_TIMEOUT_S, None))
                except (EngineDeadError, EngineClosedError):
                    return
                except RpcError as exc:
                    log.warning("%s_stats failed: %s", name, exc)
            await asyncio.sleep(OFFLOAD_STATS_PERIOD_S)

    # -- state ------------------------------------------------------------------------------------------
    @property
    def dead_reason(self) -> str | None:
        return None if self.engine is None else self.engine.dead_reason

    @property
    def state(self) -> str:
        if self.dead_reason is not None:
            return "dead"
        if self.draining:
            return "draining"
        if self.engine is None or not self.engine.ready:
            return "starting"
        return "stalled" if self.engine.stall_reason is not None else "ready"

    @property
    def model_info(self) -> ModelInfo | None:
        """The served model's facts (None until the engine has started)."""
        return None if self.engine is None else self.engine.model_info

    @property
    def served_name(self) -> str | None:
        return self.config.model.served_name

    # -- admission and delivery -------------------------------------------------------------------------
    def submit(self, request: DiffusionRequest) -> RequestStream:
        """Admit one request, or raise (QueueFullError, InvalidRequestError, EngineDeadError, StageUnavailable…)."""
        try:
            state = self.state
            if state == "dead":
                raise EngineDeadError(f"Engine is dead: {self.dead_reason}")
            if state != "ready":
                raise StageUnavailableError(f"the stage is {state}; not admitting requests")
            stream = self.engine.add_request(request)
        except DiffStageError as exc:          # refused at admission: counted as its class's outcome
            if exc.outcome is not None:
                self.metrics.count(exc.outcome)
            raise
        self._active[request.request_id] = stream
        self._idle.clear()
        return stream

    def check(self, request: DiffusionRequest) -> DiffusionRequest:
        """Everything :meth:`submit` would refuse at admission, refused now (nothing is queued): a job's create.
        Returns the request resolved against the model (its defaults filled in)."""
        try:
            state = self.state
            if state == "dead":
                raise EngineDeadError(f"Engine is dead: {self.dead_reason}")
            if self.engine is None:
                raise StageUnavailableError("the stage is starting; the model is not loaded yet")
            return self.engine.check_request(request)
        except DiffStageError as exc:
            if exc.outcome is not None:
                self.metrics.count(exc.outcome)
            raise

    async def outputs(self, stream: RequestStream) -> AsyncIterator[DiffusionOutput]:
        """The request's items in order, the final one last. Leaving early aborts the request.

        Use it under ``contextlib.aclosing`` so an early exit aborts deterministically.
        """
        rid, final = stream.request_id, None
        try:
            async for item in stream:
                if item.finished:
                    final = self._finish(item)
                    yield final
                    return
                yield item
        finally:
            self._active.pop(rid, None)
            if not self._active:
                self._idle.set()
            if final is None:            # the consumer went away before the end: stop computing for it
                if self.engine is not None:
                    self.engine.abort([rid])
                stream.close()
                self.metrics.count("aborted")
                log.info("request %s abandoned by its client: aborted", rid)

    def _finish(self, out: DiffusionOutput) -> DiffusionOutput:
        outcome = outcome_of(out.error_type)
        if outcome == "aborted" and self._drain_note is not None:
            out.error = f"Request {out.request_id} {self._drain_note}"
        images = 0 if out.images is None else len(out.images)
        self.metrics.observe_terminal(outcome, out.metrics, images)
        if outcome == "completed" and "exec_ms" in out.metrics:
            sample = out.metrics["exec_ms"] / 1e3
            self._exec_s = sample if self._exec_s is None else 0.8 * self._exec_s + 0.2 * sample
        return out

    def retry_after(self) -> int:
        """Seconds until a slot is likely free: the queue ahead × the average exec time / capacity, 1–60."""
        if self.engine is None:
            return 1
        stats = self.engine.stats()
        ahead = stats["waiting"] + 1
        return int(min(60, max(1, math.ceil((self._exec_s or 1.0) * ahead / max(1, stats["capacity"])))))

    # -- control ----------------------------------------------------------------------------------------
    def abort(self, request_ids: list[str] | None = None, all: bool = False) -> dict[str, Any]:
        """``aborted`` (were in flight), ``not_found``; ``in_step`` the aborted ones inside a step now: a step
        in progress is never interrupted, so they stop at its end (the next step boundary) and answer then."""
        if self.engine is None:
            return {"aborted": [], "not_found": list(dict.fromkeys(request_ids or [])), "in_step": []}
        executing = set(self.engine.watchdog.running())
        if all:
            aborted, not_found = self.engine.abort_all(), []
        else:
            ids = list(dict.fromkeys(request_ids or []))
            known = set(self.engine.abort(ids))
            aborted, not_found = [i for i in ids if i in known], [i for i in ids if i not in known]
        answer = {"aborted": aborted, "not_found": not_found, "in_step": [i for i in aborted if i in executing]}
        if answer["in_step"]:
            answer["message"] = (f"{', '.join(answer['in_step'])}: inside a step; stops at the next step boundary "
                                 f"(its answer, 409 request_aborted, comes then)")
        return answer

    def abort_counted(self, request_ids: list[str]) -> dict[str, int]:
        """Abort these requests; the denoising steps each in-flight one had done when its abort was registered
        (it finishes at most the step in progress after that)."""
        return {} if self.engine is None else self.engine.abort_counted(request_ids)

    def collective_rpc(self, method: str, args: tuple, kwargs: dict, timeout: float | None,
                       unique_reply_rank: int | None, abort_with: tuple[str, ...] = ()) -> Any:
        """Blocking (run it in a thread): ordered with the engine's waves on the busy-loop thread. Only the
        declared control RPCs (``stage_runtime.control``); any other name is an RpcError. ``abort_with``: requests
        aborted at the same tick boundary (``DiffusionEngine.collective_rpc``)."""
        check_control_rpc(method)
        if self.engine is None:
            raise StageUnavailableError("the stage is starting; no engine yet")
        return self.engine.collective_rpc(method, args, kwargs, timeout, unique_reply_rank, abort_with)

    # -- introspection ----------------------------------------------------------------------------------
    def work(self) -> dict[str, Any]:
        """The engine's ``load_snapshot`` (outstanding and completed pixel-steps, rate, waiting adapters)."""
        if self.engine is None:
            return {"outstanding": 0, "completed_total": 0, "rate": 0.0, "waiting_loras": []}
        return self.engine.load_snapshot()

    def stats(self, work: dict[str, Any] | None = None) -> dict[str, Any]:
        """``/v1/stats``; ``work``: a ``work()`` snapshot already taken (``/metrics`` shares one)."""
        p = self.config.parallel
        if self.engine is not None:
            load = self.engine.stats()
        else:
            load = {"waiting": 0, "running": 0, "capacity": self.config.scheduler.max_num_seqs,
                    "finished_total": 0, "aborted_total": 0, "failed_total": 0}
        work = self.work() if work is None else work
        return {"state": self.state, "waiting": load["waiting"], "running": load["running"],
                "capacity": load["capacity"], "finished_total": load["finished_total"],
                "aborted_total": load["aborted_total"], "failed_total": load["failed_total"],
                "world_size": p.world_size, "topology": p.describe(), "workers": self.workers(),
                "startup": self.startup.view(),
                "cost": {k: work[k] for k in ("outstanding", "completed_total", "rate")},
                **({"offload": self.offload} if self.config.offload.mode != "none" else {}),
                **({"compile": compile_view(self.config.compile.mode, self.compile)}
                   if self.config.compile.enabled else {}),
                **({"weights": weights_view(self.engine.weights)} if self.engine is not None else {}),
                **({"sleep": self.engine.sleep.view()} if self.engine is not None and self.config.sleep.enabled
                   else {})}

    def workers(self) -> list[dict[str, Any]]:
        """Each rank's pid and liveness: the executor's ``workers()`` when it has worker processes (mp),
        else the in-process rank 0 (uni)."""
        if self.engine is None:
            return []
        workers = getattr(self.engine.executor, "workers", None)
        if callable(workers):
            return [{"rank": int(w["rank"]), "pid": w.get("pid"), "alive": bool(w["alive"])} for w in workers()]
        alive = self.engine.dead_reason is None
        world = self.config.parallel.world_size
        if world == 1:
            return [{"rank": 0, "pid": os.getpid(), "alive": alive}]
        return [{"rank": r, "pid": None, "alive": alive} for r in range(world)]

    def requests(self) -> list[dict[str, Any]]:
        return [] if self.engine is None else self.engine.requests_snapshot()

    @property
    def num_active(self) -> int:
        return len(self._active)

    # -- drain ------------------------------------------------------------------------------------------
    async def wait_idle(self, timeout: float) -> bool:
        """True when every admitted request has been delivered to its consumer within ``timeout``."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def drain(self, timeout: float) -> list[str]:
        """Stop admitting; let in-flight requests finish within ``timeout``; abort the rest with a clear
        error. Returns the aborted request ids."""
        self.draining = True
        if await self.wait_idle(timeout):
            return []
        self._drain_note = (f"aborted: the stage is shutting down and its drain timeout ({timeout:g} s) "
                            "expired; retry on another replica")
        ids = list(self._active)
        log.warning("drain timeout %.1f s expired: aborting %d request(s)", timeout, len(ids))
        if self.engine is not None:
            self.engine.abort(ids)
        if not await self.wait_idle(10.0):
            log.error("requests still undelivered after the drain abort: %s", sorted(self._active))
        return ids
