"""DiffusionEngine: admission, one busy-loop thread, output streams, abort, RPC ordering, warmup, close.

One request's life: ``add_request`` → scheduler (WAITING) → ``schedule()`` → executor → workers →
runner → ``update_from_output`` → the request's stream gets its terminal output, and every trace of it
is dropped. All executor calls (waves and control RPCs) happen on the busy-loop thread, so they never
interleave on the transport. Scheduler state is only touched under ``self._lock``.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from stage_runtime.config import StageConfig
from stage_runtime.engine.admission import check_execution_mode
from stage_runtime.engine.delivery import OUTCOME_COUNTERS, progress_output, terminal_output
from stage_runtime.engine.stream import RequestStream
from stage_runtime.errors import (DuplicateRequestError, EngineClosedError, EngineDeadError, EngineStartupError,
                                  InvalidRequestError, RequestAbortedError, RequestFailedError)
from stage_runtime.executor.abstract import DiffusionExecutor
from stage_runtime.outputs import BatchRunnerOutput, DiffusionOutput, ProgressEvent, RunnerOutput
from stage_runtime.request import DiffusionRequest, RequestStatus, SamplingParams
from stage_runtime.sched import RequestScheduler, RequestState, StepScheduler

log = logging.getLogger(__name__)
WARMUP_PREFIX = "warmup-"

# Called on the engine thread after every executed wave / tick: (batch_size, seconds, denoising_steps).
ExecuteObserver = Callable[[int, float, int], None]


class DiffusionEngine:
    def __init__(self, config: StageConfig, executor_class: type[DiffusionExecutor] | None = None):
        self.config = config
        self._lock = threading.Condition()
        self._streams: dict[str, RequestStream] = {}
        self._abort_ids: list[str] = []
        self._awaiting_output: dict[str, str] = {}      # request id → async output id (images not here yet)
        self._rpcs: deque[tuple[str, tuple, dict, int | None, concurrent.futures.Future]] = deque()
        self._rpc_lock = threading.Lock()          # serialises direct RPCs before the loop starts
        self._thread: threading.Thread | None = None
        self._stop = False
        self._closed = False
        self._shut_down = False
        self.dead_reason: str | None = None
        self.ready = False
        self.counters = {"finished_total": 0, "aborted_total": 0, "failed_total": 0}
        self._execute_observers: list[ExecuteObserver] = []
        self.executor = (executor_class or DiffusionExecutor.get_class(config))(config)
        try:
            self.model_info = self.executor.collective_rpc("model_info", unique_reply_rank=0)
            check_execution_mode(config, self.model_info)
            self.step_mode = config.scheduler.execution_mode == "step"
            self.scheduler = (StepScheduler if self.step_mode else RequestScheduler)(config.scheduler)
        except BaseException:
            self.executor.shutdown()
            raise
        self.execute_fn = self.executor.execute_step if self.step_mode else self.executor.execute_batch
        self.executor.set_progress_hook(self._on_progress)
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
        return engine

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._busy_loop, name="diffusion-engine", daemon=True)
            self._thread.start()

    def run_warmup(self) -> None:
        request = DiffusionRequest(f"{WARMUP_PREFIX}{uuid.uuid4().hex[:8]}", "warmup",
                                   SamplingParams(num_inference_steps=2, seed=0))
        try:
            self.add_request(request).result(timeout=600)
        except Exception as exc:
            raise EngineStartupError(f"Warmup failed: {type(exc).__name__}: {exc}") from exc

    # -- admission -------------------------------------------------------------------------------------
    def add_request(self, request: DiffusionRequest) -> RequestStream:
        """Admit one request (resolved against the model once); its outputs arrive on the returned stream."""
        self._check_open()
        resolved = request.resolve(self.model_info)
        if resolved.sampling.preview_every is not None and not self.step_mode:
            raise InvalidRequestError("preview_every", resolved.sampling.preview_every,
                                      "previews need execution_mode=step (or streaming_output)")
        with self._lock:
            self._check_open()
            if request.request_id in self._streams:
                raise DuplicateRequestError(f"request_id={request.request_id!r} is already in flight")
            self.scheduler.add_request(resolved)
            stream = self._streams[request.request_id] = RequestStream(request.request_id)
            self._lock.notify_all()
        return stream

    def generate(self, prompt: str, request_id: str | None = None, timeout: float | None = None,
                 **sampling: Any) -> DiffusionOutput:
        """Sync convenience: one request, wait for its final output (raises on abort / failure)."""
        request = DiffusionRequest(request_id or uuid.uuid4().hex, prompt, SamplingParams.parse(sampling))
        return self.add_request(request).result(timeout)

    def abort(self, request_ids: str | list[str]) -> list[str]:
        """Abort waiting or running requests; returns the ids that were in flight (others are unknown)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        with self._lock:
            if self._closed:
                return []
            known = [rid for rid in ids if rid in self._streams]
            self._abort_ids.extend(known)
            self._lock.notify_all()
        return known

    def abort_all(self) -> list[str]:
        with self._lock:
            ids = [rid for rid in self._streams if not rid.startswith(WARMUP_PREFIX)]
        return self.abort(ids)

    def _check_open(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self._closed:
            raise EngineClosedError("DiffusionEngine is closed.")

    # -- control RPC -----------------------------------------------------------------------------------
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None, unique_reply_rank: int | None = None) -> Any:
        """Run a worker method on the busy-loop thread (ordered with waves); direct before the loop starts."""
        self._check_open()
        if self._thread is None:
            with self._rpc_lock:
                return self.executor.collective_rpc(method, args, kwargs, timeout, unique_reply_rank)
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._rpcs.append((method, args, kwargs or {}, unique_reply_rank, future))
            self._lock.notify_all()
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"collective_rpc {method!r} timed out after {timeout} s") from None

    # -- the busy loop ---------------------------------------------------------------------------------
    def _busy_loop(self) -> None:
        while True:
            with self._lock:
                self._wait_for_work_locked()
                if self._stop:
                    break
                rpcs, self._rpcs = self._rpcs, deque()
                self._apply_aborts_locked()
                sched_out = self.scheduler.schedule()
            self._run_rpcs(rpcs)
            if sched_out.is_empty and not (self.step_mode and sched_out.finished_req_ids):
                continue                  # (step mode still runs an empty tick to retire aborted states)
            started = time.perf_counter()
            try:
                runner_out = self.execute_fn(sched_out)
            except EngineDeadError as exc:
                self._on_executor_failure(str(exc))
                break
            except Exception as exc:
                log.exception("execute failed for %s", sched_out.scheduled_request_ids)
                runner_out = BatchRunnerOutput.of(*(RunnerOutput(rid, error=f"{type(exc).__name__}: {exc}")
                                                    for rid in sched_out.scheduled_request_ids))
            # Observed before delivery: a wave is counted by the time its requests' outputs are visible.
            self._notify_execute(len(sched_out.scheduled_request_ids), time.perf_counter() - started, runner_out)
            with self._lock:
                self._apply_aborts_locked()
                self._finalize_locked(self.scheduler.update_from_output(sched_out, runner_out))
                if self.step_mode:
                    self._emit_progress_locked(sched_out.scheduled_request_ids, runner_out)
        self._fail_rpcs(self._rpcs, "DiffusionEngine is shutting down.")

    def _wait_for_work_locked(self) -> None:
        while not self._stop and not self._abort_ids and not self._rpcs:
            if self.step_mode and self.scheduler.has_unreported_finished():
                return                    # an empty tick retires the runner state of aborted requests
            if self.scheduler.has_requests():
                delay = self.scheduler.admission_delay()
                if delay <= 0:
                    return
                self._lock.wait(delay)
            else:
                self._lock.wait(1.0)

    def _run_rpcs(self, rpcs: deque) -> None:
        for method, args, kwargs, reply_rank, future in rpcs:
            if not future.set_running_or_notify_cancel():
                continue                              # the caller gave up (timeout / cancel)
            try:
                future.set_result(self.executor.collective_rpc(method, args, kwargs, None, reply_rank))
            except Exception as exc:
                future.set_exception(exc)

    @staticmethod
    def _fail_rpcs(rpcs: deque, message: str) -> None:
        while rpcs:
            future = rpcs.popleft()[-1]
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError(message))

    def _on_progress(self, event: ProgressEvent) -> set[str]:
        """Called by the runner once per denoising step: apply aborts now; return the ids to stop."""
        with self._lock:
            self.scheduler.update_progress(event.request_ids, event.step_index)
            self._apply_aborts_locked()
            if event.step_index:
                self._emit_progress_locked(event.request_ids)
            if self._stop:
                return set(event.request_ids)
            return {rid for rid in event.request_ids if self.scheduler.get_request_state(rid) is None}

    def _apply_aborts_locked(self) -> None:
        ids, self._abort_ids = self._abort_ids, []
        if ids:
            self._finalize_locked(self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED))
        for rid in ids:                             # computed, images not here yet: drop them
            async_id = self._awaiting_output.pop(rid, None)
            if async_id is not None:
                self.executor.drop_output(async_id)
                self._deliver_locked(DiffusionOutput(rid, error=f"Request {rid} aborted.",
                                                     error_type=RequestAbortedError.error_type))

    def _finalize_locked(self, request_ids: list[str]) -> None:
        """Deliver each terminal request exactly once and drop every trace of it.

        A request whose images come later (async output) leaves the scheduler now and keeps only its
        stream and its async output id until OUTPUT_READY, an abort, or close.
        """
        for rid in request_ids:
            state = self.scheduler.pop_request_state(rid)
            output = terminal_output(state)
            async_id = state.result.async_output_id if state.result is not None and output.error is None else None
            if async_id is None:
                self._deliver_locked(output)
                continue
            self._awaiting_output[rid] = async_id
            future = self.executor.wait_output_ready(async_id)
            future.add_done_callback(functools.partial(self._on_output_ready, output, async_id))

    def _on_output_ready(self, output: DiffusionOutput, async_id: str, future) -> None:
        if future.cancelled():
            return                                  # dropped: the abort already delivered
        try:
            output.images = future.result()
        except Exception as exc:
            output.error, output.error_type = f"Output lost: {exc}", RequestFailedError.error_type
        with self._lock:
            if self._awaiting_output.get(output.request_id) == async_id:
                del self._awaiting_output[output.request_id]
                self._deliver_locked(output)

    def _deliver_locked(self, output: DiffusionOutput) -> None:
        rid = output.request_id
        if not rid.startswith(WARMUP_PREFIX):
            self.counters[OUTCOME_COUNTERS.get(output.error_type, "failed_total")] += 1
        stream = self._streams.pop(rid, None)
        if stream is not None:
            stream.put(output)

    def _emit_progress_locked(self, request_ids, previews: BatchRunnerOutput | None = None) -> None:
        """Non-final items for requests that asked for progress (``stream``) or previews."""
        for rid in request_ids:
            state, stream = self.scheduler.get_request_state(rid), self._streams.get(rid)
            if state is None or state.status.finished or stream is None or not self._wants_progress(state):
                continue
            result = previews.get(rid) if previews is not None else None
            stream.put(progress_output(state, result.images if result is not None else None))

    def _wants_progress(self, state: RequestState) -> bool:
        s = state.request.sampling
        return s.stream or s.preview_every is not None or self.config.scheduler.streaming_output

    # -- failure and close -----------------------------------------------------------------------------
    def _on_executor_failure(self, reason: str) -> None:
        """Fail closed: every in-flight request ends with EngineDeadError; nothing new is admitted."""
        with self._lock:
            if self.dead_reason is None:
                self.dead_reason = reason
            self._stop = True
            self._lock.notify_all()
        self._fail_streams(f"Engine is dead: {self.dead_reason}", EngineDeadError.error_type)

    def _fail_streams(self, message: str, error_type: str) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
            self._awaiting_output.clear()
        for rid, stream in streams.items():
            stream.put(DiffusionOutput(rid, error=message, error_type=error_type))

    def close(self, timeout: float = 10.0) -> None:
        """Idempotent. Pending streams get a clear error; the busy loop stops; the executor shuts down."""
        with self._lock:
            self._closed = self._stop = True
            self.ready = False
            self._lock.notify_all()
        self._fail_streams("DiffusionEngine is closed.", EngineClosedError.error_type)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                log.error("engine loop still busy after %.0f s; shutdown deferred to the next close()", timeout)
                return
        if not self._shut_down:
            self._shut_down = True
            with self._lock:
                self._fail_rpcs(self._rpcs, "DiffusionEngine is shutting down.")
                self.scheduler.close()
            self.executor.shutdown()

    # -- observation -----------------------------------------------------------------------------------
    def add_execute_observer(self, observer: ExecuteObserver) -> None:
        """Metrics hook: ``observer(batch_size, seconds, steps)`` after every wave (request mode: the steps
        the wave ran) or tick (step mode: one step). Runs on the engine thread; keep it cheap."""
        self._execute_observers.append(observer)

    def _notify_execute(self, batch_size: int, seconds: float, runner_out: BatchRunnerOutput) -> None:
        if not batch_size or not self._execute_observers:
            return
        if self.step_mode:
            steps = 1
        else:
            steps = max((o.step_index or 0 for o in runner_out.outputs.values()), default=0) or 1
        for observer in self._execute_observers:
            try:
                observer(batch_size, seconds, steps)
            except Exception:
                log.exception("execute observer %r failed", observer)

    # -- introspection ---------------------------------------------------------------------------------
    @property
    def state(self) -> str:
        if self.dead_reason is not None:
            return "dead"
        if self._closed:
            return "closed"
        return "ready" if self.ready else "starting"

    def stats(self) -> dict[str, int]:
        """Load and outcome counters in one consistent snapshot (``GET /v1/stats``)."""
        with self._lock:
            return {"waiting": self.scheduler.num_waiting_reqs, "running": self.scheduler.num_running_reqs,
                    "capacity": self.scheduler.max_num_running_reqs, **self.counters}

    def requests_snapshot(self) -> list[dict[str, Any]]:
        """In-flight requests with state and step progress (``GET /v1/requests``)."""
        with self._lock:
            states = [self.scheduler.get_request_state(rid) for rid in self._streams]
        return [{"request_id": s.request_id, "state": s.status.name.lower(), "step": s.step_index,
                 "num_steps": s.request.num_steps} for s in states if s is not None]

    def num_request_states(self) -> int:
        """Per-request state held by the engine and its scheduler (0 when idle)."""
        with self._lock:
            return len(self._streams) + self.scheduler.num_states
