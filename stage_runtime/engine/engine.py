"""DiffusionEngine: admission, the engine step and its busy-loop thread, abort, failure, close (with its parts:
engine.warmup, engine.control_rpc, engine.introspection; sleep mode and the profiler are engine.sleep_control and
engine.profiler_control).

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
from stage_runtime.engine.aborts import EngineAborts
from stage_runtime.engine.admission import admit, check_execution_mode, family_check
from stage_runtime.engine.control_rpc import EngineControlRpc
from stage_runtime.engine.cost_meter import CostMeter
from stage_runtime.engine.introspection import EngineIntrospection
from stage_runtime.engine.limits import max_request_cost
from stage_runtime.engine.lora_table import LoraTable
from stage_runtime.engine.observers import ExecuteObservers
from stage_runtime.engine.output_table import OutputTable
from stage_runtime.engine.profiler_control import ProfilerControl
from stage_runtime.engine.prompt_length import PromptLength
from stage_runtime.engine.result_cache import ResultCache
from stage_runtime.engine.rpc_queue import ControlRpcQueue
from stage_runtime.engine.sleep_control import SleepControl
from stage_runtime.engine.stream import RequestStream
from stage_runtime.engine.warmup import EngineWarmup
from stage_runtime.engine.watchdog import StepWatchdog
from stage_runtime.errors import DuplicateRequestError, EngineClosedError, EngineDeadError
from stage_runtime.executor.abstract import DiffusionExecutor
from stage_runtime.outputs import BatchRunnerOutput, DiffusionOutput, ProgressEvent
from stage_runtime.request import DiffusionRequest, RequestStatus, SamplingParams
from stage_runtime.sched import RequestScheduler, StepScheduler
from stage_runtime.scheduler_output import SchedulerOutput

log = logging.getLogger(__name__)


class DiffusionEngine(EngineWarmup, EngineAborts, EngineControlRpc, EngineIntrospection):
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
                config.scheduler, config.scheduler.max_num_seqs * config.parallel.dp_size if config.offload.dlo
                else None)
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
        self.sleep = SleepControl(self, config)              # sleep mode: scheduling held while the ranks sleep
        self.profiler = ProfilerControl(self, config.profiler)
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
            self.sleep.admitted()                     # asleep: a wake starts; the request waits for it
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
                 reference: Any = None, video_input: Any = None, **sampling: Any) -> DiffusionOutput:
        """Sync convenience: one request (a video when the model makes videos, from ``reference``, a uint8 image,
        for image-to-video, or ``video_input``, a VideoInput, for video-to-video), wait for its final output (raises
        on abort / failure)."""
        return self.add_request(DiffusionRequest(request_id or uuid.uuid4().hex, prompt, SamplingParams.parse(sampling),
                                                 video=self.model_info.video, reference=reference,
                                                 video_input=video_input)).result(timeout)

    def _check_open(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self._closed:
            raise EngineClosedError("DiffusionEngine is closed.")

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
            # asleep (or falling asleep, or waking): the queue waits; aborts and RPCs still run
            sched_out = SchedulerOutput(-1, mode=self.scheduler.mode) if self.sleep.gated else self.scheduler.schedule()
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
                if self.sleep.gated:
                    self._lock.wait(1.0)              # the wake ungates and notifies
                    continue
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
        self.sleep.close()
        self.profiler.close()
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
