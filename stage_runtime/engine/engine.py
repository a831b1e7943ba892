"""DiffusionEngine: admission, the engine step and its busy-loop thread, abort, RPC ordering, warmup, close.

One request's life: ``add_request`` → scheduler (WAITING) → ``step()``: ``schedule()`` →
``executor.execute_model(sched_out)`` → ``scheduler.update_from_output(...)`` → the request's stream
gets its terminal output (``engine.output_table``), and every trace of it is dropped. All executor calls
(waves, ticks and control RPCs) happen on the busy-loop thread, so they never interleave on the
transport. Scheduler and output-table state is only touched under ``self._lock``.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

from stage_runtime.checkpoint import check_resume
from stage_runtime.config import StageConfig
from stage_runtime.engine.admission import admit, check_execution_mode, family_check
from stage_runtime.engine.compile_warmup import compile_warmup_requests
from stage_runtime.engine.cost_meter import CostMeter
from stage_runtime.engine.limits import max_request_cost
from stage_runtime.engine.lora_table import LORA_RPCS, LoraTable
from stage_runtime.engine.observers import ExecuteObservers
from stage_runtime.engine.output_table import OutputTable, warmup_request
from stage_runtime.engine.prompt_length import PromptLength
from stage_runtime.engine.result_cache import ResultCache
from stage_runtime.engine.rpc_queue import ControlRpcQueue
from stage_runtime.engine.stream import RequestStream
from stage_runtime.engine.watchdog import StepWatchdog
from stage_runtime.errors import (ConfigError, DuplicateRequestError, EngineClosedError, EngineDeadError,
                                  EngineStartupError, InvalidRequestError)
from stage_runtime.executor.abstract import DiffusionExecutor
from stage_runtime.outputs import BatchRunnerOutput, DiffusionOutput, ProgressEvent
from stage_runtime.request import DiffusionRequest, RequestStatus, SamplingParams
from stage_runtime.sched import RequestScheduler, StepScheduler
from stage_runtime.scheduler_output import SchedulerOutput

log = logging.getLogger(__name__)


class DiffusionEngine:
    def __init__(self, config: StageConfig, executor_class: type[DiffusionExecutor] | None = None):
        self.config = config
        self._lock = threading.Condition(threading.RLock())
        self._abort_ids: list[str] = []
        self._rpcs = ControlRpcQueue()
        self._rpc_lock = threading.Lock()          # serialises direct RPCs before the loop starts
        self._thread: threading.Thread | None = None
        self._stop = self._closed = self._shut_down = False
        self.dead_reason: str | None = None
        self.dead_kind = "WorkerDied"              # the termination reason: WorkerDied, or StepStalled (watchdog)
        self.ready = False
        self.compile_warmup_stats: list[dict] | None = None   # every rank's compile stats at warm-up's end
        self.observers = ExecuteObservers()      # metrics hooks after every wave / tick (engine thread)
        self.executor = (executor_class or DiffusionExecutor.get_class(config))(config)
        try:
            self.model_info = self.executor.collective_rpc("model_info", unique_reply_rank=0)
            self.weights = self.executor.collective_rpc("weight_stats")     # every rank's weights, as loaded
            check_execution_mode(config, self.model_info)
            self.check_family = family_check(self.model_info)   # the family's refusals, before queueing
            self.prompt_length = PromptLength.for_model(self.model_info)   # a prompt the encoder would cut
            self.scheduler = (StepScheduler if config.scheduler.execution_mode == "step" else RequestScheduler)(
                config.scheduler)
            # LoRA names, pinning, max_loras (and what ranks hold)
            self.loras = LoraTable(self._lock, self.rank_rpc, self.model_info, config, self._live_requests)
        except BaseException:
            self.executor.shutdown()
            raise
        self.outputs = OutputTable(self._lock, self.executor, config.scheduler.streaming_output)
        self.counters = self.outputs.counters
        self.cost = CostMeter()                  # outstanding pixel-steps and work done (``load_snapshot``)
        self.max_request_cost = max_request_cost(config.limits, self.model_info)
        self.watchdog = StepWatchdog(config.limits, self._fail_stalled)      # armed once ready
        self.result_cache = ResultCache.from_config(config)      # off (never hits) unless result_max_bytes > 0
        self.outputs.on_final = self.result_cache.on_delivered
        self.executor.set_progress_hook(self._on_progress)
        self.executor.set_output_hook(self.outputs.on_output_ready)
        self.executor.register_failure_callback(self._on_executor_failure)

    @classmethod
    def make_engine(cls, config: StageConfig, **kwargs: Any) -> "DiffusionEngine":
        """Construct, start the busy loop and run the warmup request; on any failure close and raise."""
        engine = cls(config, **kwargs)
        try:
            engine.start()
            if config.warmup:
                engine.run_warmup()
        except BaseException:
            engine.close()
            raise
        engine.ready = True
        engine.watchdog.start()
        return engine

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._busy_loop, name="diffusion-engine", daemon=True)
            self._thread.start()

    def run_warmup(self, compile_budget_s: float | None = None) -> None:
        """The warm-up request, then (compile on) the compile warm-up, its compiling bounded by compile.timeout_s
        or ``compile_budget_s`` (what the stage's startup budget leaves) when shorter."""
        try:
            if self.config.compile.enabled:
                self.collective_rpc("compile_warmup", (compile_budget_s,))
            self.add_request(warmup_request(self.model_info)).result(timeout=600)
            if self.config.compile.enabled:
                self._compile_warmup()
        except ConfigError:
            raise
        except Exception as exc:
            raise EngineStartupError(f"Warmup failed: {type(exc).__name__}: {exc}") from exc

    def _compile_warmup(self) -> None:
        """Every compile shape at 1 row and 2+ rows (engine.compile_warmup), then every rank told that warm-up is
        over (``compile_warmed``: a later graph is a recompile). Each rank bounds its own compiling (timeout_s)."""
        wait = self.config.compile.timeout_s + 600
        for label, request in compile_warmup_requests(self.config.compile, self.model_info):
            try:
                self.add_request(request).result(timeout=wait)
            except InvalidRequestError as exc:
                raise ConfigError(f"compile.shapes: {label} cannot be served by {self.model_info.pipeline_class}: "
                                  f"{exc}") from None
        self.compile_warmup_stats = self.collective_rpc("compile_warmed")

    # -- admission -------------------------------------------------------------------------------------
    def add_request(self, request: DiffusionRequest) -> RequestStream:
        """Admit one request (resolved against the model once); its outputs arrive on the returned stream."""
        self._check_open()
        resolved = self._resolve(request)
        key, hit = self.result_cache.lookup(resolved)
        with self._lock:
            self._check_open()
            self.loras.admit(resolved)                 # still loaded as resolved; LRU touched, request counted
            if hit is not None:               # an exact repeat: the stored images, nothing runs
                self.counters["finished_total"] += 1
                return hit
            if request.request_id in self.outputs:
                raise DuplicateRequestError(f"request_id={request.request_id!r} is already in flight")
            self.scheduler.add_request(resolved)
            self.result_cache.expect(request.request_id, key)
            stream = self.outputs.open(request.request_id)
            self._lock.notify_all()
        return stream

    def check_request(self, request: DiffusionRequest) -> DiffusionRequest:
        """What :meth:`add_request` would refuse, refused now (InvalidRequestError naming the field), without
        queuing anything: the request resolved against the model (a job is checked at create, run later)."""
        self._check_open()
        return self._resolve(request)

    def _resolve(self, request: DiffusionRequest) -> DiffusionRequest:
        """Admission (engine.admission), the adapters resolved (an unknown one: 400; each file's digest recorded),
        and a checkpoint to resume from checked against the model and the request (400 naming resume_from)."""
        resolved = self.loras.resolve(admit(request, self.model_info, self.scheduler.mode, self.check_family,
                                            self.max_request_cost, self.prompt_length))
        if resolved.resume_from is not None:
            check_resume(resolved, self.model_info)
        return resolved

    def generate(self, prompt: str, request_id: str | None = None, timeout: float | None = None,
                 reference: Any = None, **sampling: Any) -> DiffusionOutput:
        """Sync convenience: one request (a video when the model makes videos, from ``reference``, a uint8 image,
        for image-to-video), wait for its final output (raises on abort / failure)."""
        return self.add_request(DiffusionRequest(request_id or uuid.uuid4().hex, prompt, SamplingParams.parse(sampling),
                                                 video=self.model_info.video, reference=reference)).result(timeout)

    def abort(self, request_ids: str | list[str]) -> list[str]:
        """Abort waiting or running requests; returns the ids that were in flight (others are unknown)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        with self._lock:
            if self._closed:
                return []
            known = [rid for rid in ids if rid in self.outputs]
            self._abort_ids.extend(known)
            self._lock.notify_all()
        return known

    def abort_counted(self, request_ids: list[str]) -> dict[str, int]:
        """Abort as :meth:`abort`, and say how many denoising steps each in-flight one had done when its abort was
        registered (after it, a running request finishes at most the step in progress)."""
        with self._lock:
            done = {s.request_id: s.step_index for s in self.scheduler.live_states(request_ids)}
            return {rid: done.get(rid, 0) for rid in self.abort(request_ids)}

    def abort_all(self) -> list[str]:
        with self._lock:
            return self.abort(self.outputs.user_request_ids())      # (the lock is re-entrant)

    def _check_open(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self._closed:
            raise EngineClosedError("DiffusionEngine is closed.")

    # -- control RPC -----------------------------------------------------------------------------------
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None, unique_reply_rank: int | None = None,
                       abort_with: tuple[str, ...] = ()) -> Any:
        """A declared control RPC (``stage_runtime.control``) on the busy-loop thread, ordered with waves;
        direct before the loop starts. An undeclared name, a failed rank or a timeout: RpcError. The LoRA
        RPCs go through the engine's adapter table (engine.lora_table), which then tells every rank.
        ``abort_with``: requests aborted at the tick boundary the RPC runs at (before their runner state is
        freed), so no step runs between the two: a job's hand-off checkpoints its last step and stops there."""
        if method in LORA_RPCS:
            self._check_open()
            return self.loras.control(method, tuple(args), kwargs or {})
        return self.rank_rpc(method, args, kwargs, timeout, unique_reply_rank, abort_with)

    def rank_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None, timeout: float | None = None,
                 unique_reply_rank: int | None = None, abort_with: tuple[str, ...] = ()) -> Any:
        self._check_open()
        if self._thread is None:
            with self._rpc_lock:
                try:
                    return self.executor.collective_rpc(method, args, kwargs, timeout, unique_reply_rank)
                finally:
                    self.abort(list(abort_with))
        with self._lock:                 # one _schedule() takes both: the aborts, then the RPC before any execute
            future = self._rpcs.submit(method, args, kwargs, unique_reply_rank)
            self.abort(list(abort_with))
            self._lock.notify_all()
        return self._rpcs.wait(future, method, timeout)

    # -- the engine step: schedule → execute_model → update_from_output ---------------------------------
    def step(self) -> bool:
        """One iteration of the engine; the busy loop calls it, a test may call it directly (no thread).
        Returns False once the engine must stop (the executor died)."""
        sched_out = self._schedule()
        if not self.scheduler.should_execute(sched_out):
            return True
        runner_out = self._execute_model(sched_out)
        if runner_out is None:
            return False
        self._update_from_output(sched_out, runner_out)
        return True

    def _schedule(self) -> SchedulerOutput:
        """Apply queued aborts and passed deadlines, pick the next wave / tick; then run queued control RPCs."""
        with self._lock:
            rpcs = self._rpcs.take()
            self._apply_aborts_locked()
            self._finalize_locked(self.scheduler.expire_deadlines())
            sched_out = self.scheduler.schedule()
        self._rpcs.run(rpcs, self.executor)
        return sched_out

    def _execute_model(self, sched_out: SchedulerOutput) -> BatchRunnerOutput | None:
        """The executor call, timed for the observers; a failed call fails its requests (None: engine dead)."""
        started = time.perf_counter()
        self.watchdog.begin(sched_out.scheduled_request_ids)
        try:
            runner_out = self.executor.execute_model(sched_out)
        except EngineDeadError as exc:
            self._on_executor_failure(str(exc))
            return None
        except Exception as exc:
            log.exception("execute failed for %s", sched_out.scheduled_request_ids)
            runner_out = BatchRunnerOutput.failed(sched_out.scheduled_request_ids, exc)
        finally:
            self.watchdog.end()
        # Observed before delivery: a wave is counted by the time its requests' outputs are visible.
        self.observers.notify(sched_out, time.perf_counter() - started, runner_out)
        return runner_out

    def _update_from_output(self, sched_out: SchedulerOutput, runner_out: BatchRunnerOutput) -> None:
        with self._lock:
            self._apply_aborts_locked()
            self._finalize_locked(self.scheduler.update_from_output(sched_out, runner_out))
            if sched_out.mode == "step":
                self.outputs.progress(self.scheduler.live_states(sched_out.scheduled_request_ids),
                                      {rid: out.images for rid, out in runner_out.outputs.items()})

    def _busy_loop(self) -> None:
        while self._wait_for_work() and self.step():
            pass
        with self._lock:
            self._rpcs.fail_all("DiffusionEngine is shutting down.")

    def _wait_for_work(self) -> bool:
        """Block until there is something to do; False when the engine is stopping."""
        with self._lock:
            while not self._stop and not self._abort_ids and not self._rpcs:
                if self.scheduler.has_unreported_finished():
                    break                     # an empty tick retires the runner state of aborted requests
                delay = self.scheduler.admission_delay() if self.scheduler.has_requests() else 1.0
                if delay <= 0:
                    break                     # a wave is due now
                self._lock.wait(delay)
            return not self._stop

    def _on_progress(self, event: ProgressEvent) -> set[str]:
        """Called by the runner once per denoising step and as a call enters its encode and decode phases: apply
        aborts and deadlines now; return the ids to stop (at a denoising step)."""
        self.watchdog.progress(event.step_index, event.num_steps, event.phase)
        with self._lock:
            self.scheduler.update_progress(event.request_ids, event.step_index, event.phase)
            self._apply_aborts_locked()
            self._finalize_locked(self.scheduler.expire_deadlines())
            if event.step_index or event.phase != "denoise":      # step 0 of denoise: the encode item said it
                self.outputs.progress(self.scheduler.live_states(event.request_ids))
            if self._stop:
                return set(event.request_ids)
            return {rid for rid in event.request_ids if self.scheduler.get_request_state(rid) is None}

    def _apply_aborts_locked(self) -> None:
        ids, self._abort_ids = self._abort_ids, []
        if ids:
            self._finalize_locked(self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED))
            self.outputs.abort(ids)                  # computed, images not here yet: drop them

    def _finalize_locked(self, request_ids: list[str]) -> None:
        """Each terminal request leaves the scheduler and is delivered exactly once."""
        states = [self.scheduler.pop_request_state(rid) for rid in request_ids]
        self.cost.finished(states)
        self.outputs.finalize(states)

    # -- failure and close -----------------------------------------------------------------------------
    def _fail_stalled(self, reason: str) -> None:
        """The watchdog's verdict: fail closed as a dead worker would (the executor stops its ranks)."""
        with self._lock:
            if self.dead_reason is None:
                self.dead_kind = "StepStalled"
        self.executor.mark_dead(f"step stalled: {reason}")

    @property
    def stall_reason(self) -> str | None:
        """Why this replica should get no new work now (a running step made no progress), or None."""
        return self.watchdog.stalled()

    def _on_executor_failure(self, reason: str) -> None:
        """Fail closed: every in-flight request ends with EngineDeadError; nothing new is admitted."""
        with self._lock:
            if self.dead_reason is None:
                self.dead_reason = reason
            self._stop = True
            self._lock.notify_all()
            self.outputs.fail_all(f"Engine is dead: {self.dead_reason}", EngineDeadError.error_type)

    def close(self, timeout: float = 10.0) -> None:
        """Idempotent. Pending streams get a clear error; the busy loop stops; the executor shuts down."""
        with self._lock:
            self._closed = self._stop = True
            self.ready = False
        self.watchdog.stop()
        with self._lock:
            self._lock.notify_all()
            self.outputs.fail_all("DiffusionEngine is closed.", EngineClosedError.error_type)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                log.error("engine loop still busy after %.0f s; shutdown deferred to the next close()", timeout)
                return
        if not self._shut_down:
            self._shut_down = True
            with self._lock:
                self._rpcs.fail_all("DiffusionEngine is shutting down.")
                self.scheduler.close()
            self.executor.shutdown()

    # -- introspection ---------------------------------------------------------------------------------
    @property
    def state(self) -> str:
        """dead (fail closed) → closed → ready (after warmup) → starting."""
        return ("dead" if self.dead_reason is not None else "closed" if self._closed
                else "ready" if self.ready else "starting")

    def stats(self) -> dict[str, int]:
        """Load and outcome counters in one consistent snapshot (``GET /v1/stats``)."""
        with self._lock:
            return {"waiting": self.scheduler.num_waiting_reqs, "running": self.scheduler.num_running_reqs,
                    "capacity": self.scheduler.max_num_running_reqs, **self.counters}

    def load_snapshot(self) -> dict[str, Any]:
        """Outstanding and completed work in pixel-steps, the completion rate, the waiting requests' adapters
        (``engine.cost_meter``: ``/v1/stats`` and ``/metrics``)."""
        with self._lock:
            return self.cost.snapshot(self.scheduler.live_states(list(self.outputs.streams)))

    def _live_requests(self) -> list[DiffusionRequest]:
        """The requests in flight (waiting, running, preempted); under the lock (the LoRA table's port)."""
        return [state.request for state in self.scheduler.live_states(list(self.outputs.streams))]

    def requests_snapshot(self) -> list[dict[str, Any]]:
        """In-flight requests with state and step progress (``GET /v1/requests``)."""
        with self._lock:
            return [state.snapshot() for state in self.scheduler.live_states(self.outputs.streams)]

    def num_request_states(self) -> int:
        """Per-request state held by the engine and its scheduler (0 when idle)."""
        with self._lock:
            return len(self.outputs.streams) + self.scheduler.num_states
