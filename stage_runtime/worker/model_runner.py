"""DiffusionModelRunner: the loaded pipeline and per-request execution on one rank.

Step mode: each request's StepRequestState lives here (never crosses a process); a tick prepares new
requests once, runs ONE denoiser forward for all scheduled requests, steps each one, decodes finished
ones (and previews), and drops the state of every request that finished, failed or was aborted. A
request the scheduler preempted keeps its state here untouched (copied to host memory while
``scheduler.preempted_offload_max_bytes`` allows) until it resumes or ends.

Request mode: one wave of key-compatible requests runs as ONE pipeline call (per-image generators,
results mapped back by request id). A forward pre-hook on the denoiser marks each denoising step: it
reports progress to the engine and stops work the engine cancelled (an abort lands within one step).
A failing fused call is retried request by request, so one bad request never fails its batch-mates.

Compile (``config.compile.mode != "none"``, stage_runtime.compilation): installed right after loading, before any other
wrapper; a call whose LoRA rows must act inside the compiled blocks (or, under full compile, a block-cache call) runs
eagerly (``_compile_scope``).

Offload (``config.offload.mode != "none"``): the runner owns an Offloader (built after loading) whose
forward hooks bring each component in before use; the runner releases everything it holds when a
pipeline call ends (request mode), when no step state is left (step mode), and at close.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from stage_runtime.config import StageConfig
from stage_runtime.errors import InvalidRequestError, WorkerFatalError
from stage_runtime.checkpoint import read_manifest
from stage_runtime.compilation import install_compiler
from stage_runtime.quantization import quantize
from stage_runtime.quantization.gguf import load_gguf_pipeline
from stage_runtime.models import block_cache, prompt_cache, step_checkpoint
from stage_runtime.models.adapter import PipelineAdapter
from stage_runtime.model_info import ModelInfo
from stage_runtime.models.lora.manager import build_lora_manager
from stage_runtime.models.registry import resolve_adapter_class
from stage_runtime.offload import build_offloader, load_device, place_unsharded
from stage_runtime.outputs import BatchRunnerOutput, Decoded, ProgressHook, RunnerOutput
from stage_runtime.request import DiffusionRequest, adapter_identity
from stage_runtime.scheduler_output import SchedulerOutput
from stage_runtime.worker.step_tracker import Interrupted, StepTracker, report_phase
from stage_runtime.models.step_state import StepRequestState

log = logging.getLogger(__name__)


class DiffusionModelRunner:
    def __init__(self, config: StageConfig, device: torch.device, progress_hook: ProgressHook | None = None):
        self.config = config
        self.device = device
        self.progress_hook = progress_hook
        self.adapter: PipelineAdapter | None = None
        self.model_info: ModelInfo | None = None
        self._active: StepTracker | None = None       # the pipeline call in flight, if any (request mode)
        self.step_states: dict[str, StepRequestState] = {}    # step mode: request id → its step state
        self.parked: dict[str, int] = {}      # preempted request id → its bytes on the host (0: left in place)
        self.offloader = None                                  # weight residency owner (offload mode != none)
        self.compiler = None                                   # the compiled denoiser (compile mode != none)
        self.weights = None                                    # quantization.WeightReport: bytes per component
        self.prompt_cache = None                               # cache.prompt_max_bytes > 0 and a text encoder
        self.writes_checkpoints = True        # this rank writes its replica's step checkpoints (the worker says)
        self.rank = 0                         # the worker's rank (the compile crash guard's key)
        self.groups = None                    # the worker's ParallelGroups (DLO gathers over its dp group)

    def load_model(self, parallelize: Callable[[object], None] | None = None) -> ModelInfo:
        """Load the model; ``parallelize(adapter)`` (the worker's distributed.apply) runs before the startup LoRA
        adapters are read, so their factors are cut to the tensor-parallel shards and hook the sharded layers."""
        adapter_cls = resolve_adapter_class(self.config.model)
        if self.config.quantization.method == "gguf":             # the denoiser from its pre-quantized file
            self.adapter = load_gguf_pipeline(adapter_cls, self.config.model, self.config.quantization, self.device)
        else:
            on = load_device(self.config.offload, self.device)      # DLO on an accelerator: the host first
            self.adapter = adapter_cls.load(self.config.model.path, on, self.config.model.dtype)
            if on != self.device:
                place_unsharded(self.config.offload, self.adapter, self.device)
        # the weights as loaded name the model; a checkpoint resumes only under the same quantization
        fingerprint = step_checkpoint.model_fingerprint(self.adapter, self.config.quantization.method)
        self.weights = quantize(self.adapter, self.config, self.device)      # the stored weights, before any wrapper
        self.weights.check_offload(self.config.offload)
        self.compiler = install_compiler(self.adapter, self.config, self.device, self.rank)
        if self.config.limits.decode_tile_side is not None:
            self.adapter.bound_decode(self.config.limits.decode_tile_side)
        self.model_info = dataclasses.replace(self.adapter.info(), block_cache_refusal=block_cache.block_cache_refusal(
            self.adapter, self.config), fingerprint=fingerprint)
        self.offloader = build_offloader(self.config.offload, self.adapter, self.device, self.groups)
        self.prompt_cache = prompt_cache.install(self.adapter.pipe, self.config.cache.prompt_max_bytes)
        if parallelize is not None:
            parallelize(self.adapter)
        self.adapter.loras = build_lora_manager(self.adapter, self.config, self.device)   # startup adapters
        return self.model_info

    def execute_model(self, sched_out: SchedulerOutput) -> BatchRunnerOutput:
        """Run one scheduler output as its ``mode`` says: a request-mode wave or a step-mode tick."""
        if sched_out.mode == "step":
            return self._execute_step(sched_out)
        return self._execute_wave(sched_out)

    # -- request mode ----------------------------------------------------------------------------------
    def _execute_wave(self, sched_out: SchedulerOutput) -> BatchRunnerOutput:
        out = BatchRunnerOutput()
        runnable: list[DiffusionRequest] = []
        for new in sched_out.scheduled_new_reqs:
            try:
                self._assert_admitted(new.request)
                runnable.append(new.request)
            except Exception as exc:      # it never reaches the fused call: its batch-mates run
                out.outputs[new.request_id] = RunnerOutput(new.request_id, error=f"{type(exc).__name__}: {exc}")
        groups = [runnable] if self.adapter.supports_request_batch else [[r] for r in runnable]
        for group in filter(None, groups):
            out.outputs.update(self._run_isolated(group))
        return out

    def _assert_admitted(self, request: DiffusionRequest) -> None:
        """The family's admission check once more, as an assertion: the engine refuses (400) what it refuses
        before queueing, so a refusal here means an unchecked request reached the rank: an internal error."""
        try:
            self.adapter.check_request(request, self.model_info)
        except InvalidRequestError as exc:
            log.error("request %s reached the rank unchecked: %s", request.request_id, exc)
            raise RuntimeError(f"internal error: request {request.request_id!r} reached the rank without the "
                               f"family's admission check ({exc})") from None

    def _run_isolated(self, requests: list[DiffusionRequest]) -> dict[str, RunnerOutput]:
        try:
            return self._call(requests)
        except Exception as exc:
            if isinstance(exc, WorkerFatalError):
                raise
            if len(requests) == 1:
                rid = requests[0].request_id
                log.warning("request %s failed: %s: %s", rid, type(exc).__name__, exc)
                return {rid: RunnerOutput.failed(rid, exc)}
            log.warning("fused call of %d requests failed (%s); retrying one by one", len(requests), exc)
            results: dict[str, RunnerOutput] = {}
            for request in requests:
                results.update(self._run_isolated([request]))
            return results

    def _call(self, requests: list[DiffusionRequest]) -> dict[str, RunnerOutput]:
        """ONE pipeline call for the group; outputs keyed by request id."""
        ids = [r.request_id for r in requests]
        tracker = StepTracker(ids, requests[0].num_steps, self.progress_hook)
        self._active = tracker
        handles = tracker.attach(self.adapter.denoiser, self.adapter.pipe)
        caches = {r.request_id: c for r in requests if (c := self._new_cache(r)) is not None}
        start = time.perf_counter()
        try:
            with (torch.inference_mode(), self._adapters(*requests), self._lora_guard(requests),
                  self._compile_scope(requests, cached=bool(caches)),
                  block_cache.session(self.adapter, block_cache.wave_rows(self.adapter, requests, caches))):
                images = self.adapter.run_batch(requests)
        except Interrupted:
            images = {}
        finally:
            for handle in handles:
                handle.remove()
            self._active = None
            if self.offloader is not None:
                self.offloader.release_all()
        compute_ms = (time.perf_counter() - start) * 1e3
        outputs = {}
        for rid in ids:
            if rid in tracker.cancelled:
                outputs[rid] = RunnerOutput(rid, aborted=True, step_index=tracker.step_index)
            elif rid in images:
                decoded = Decoded.of(images[rid])
                outputs[rid] = RunnerOutput(rid, images=decoded.images, audio=decoded.audio,
                                            step_index=tracker.step_index, compute_ms=compute_ms,
                                            cache=caches[rid].counts() if rid in caches else None)
            # A missing id is left out on purpose: the scheduler ends it FINISHED_ERROR ("No output result").
        return outputs

    # -- step mode -------------------------------------------------------------------------------------
    def _execute_step(self, sched_out: SchedulerOutput) -> BatchRunnerOutput:
        """One tick: drop finished states, prepare new requests, ONE denoiser forward for all, step each (the engine
        checked at startup that the family has the step contract: engine/admission.py ``check_execution_mode``)."""
        try:
            return self._tick_all(sched_out)
        finally:
            if self.offloader is not None and not self.step_states:
                self.offloader.release_all()

    def _tick_all(self, sched_out: SchedulerOutput) -> BatchRunnerOutput:
        for rid in sched_out.finished_req_ids:
            self._drop_state(rid)
        for rid in sched_out.preempted_req_ids:
            self._park(rid)
        for rid in sched_out.resumed_req_ids:
            self._unpark(rid)
        out = BatchRunnerOutput()
        in_call = [new.request for new in sched_out.scheduled_new_reqs] + [
            self.step_states[rid].request for rid in sched_out.scheduled_request_ids if rid in self.step_states]
        with torch.inference_mode(), self._lora_guard(in_call):
            for new in sched_out.scheduled_new_reqs:
                try:
                    self._prepare(new.request)
                except Exception as exc:
                    out.outputs[new.request_id] = self._step_error(new.request_id, exc)   # (re-raises fatal)
            states = []
            for rid in sched_out.scheduled_request_ids:
                if rid in self.step_states and self.step_states[rid].finished:    # resumed denoised: decode only
                    out.outputs[rid] = self._advanced(self.step_states[rid])
                elif rid in self.step_states:
                    states.append(self.step_states[rid])
                elif rid not in out.outputs:
                    out.outputs[rid] = RunnerOutput(rid, error=f"No step state for request {rid}")
            if states:
                out.outputs.update(self._tick(states))
        return out

    def _prepare(self, request: DiffusionRequest) -> None:
        """A new request's step state: encoded from scratch, then laid over with its checkpoint when it resumes."""
        self._assert_admitted(request)
        start = 0 if request.resume_from is None else int(read_manifest(request.resume_from)["step"])
        report_phase(self.progress_hook, [request.request_id], start, request.num_steps, "encode")
        with self._adapters(request):
            state = self.adapter.prepare_encode(request)
        state.cache = self._new_cache(request)
        if request.resume_from is not None:
            state = step_checkpoint.restore(state, self.model_info)
        self.step_states[request.request_id] = state

    def checkpoint(self, request_id: str, path: str | None) -> dict | None:
        """Write the request's step state, as it is between ticks, to ``path`` (models.step_checkpoint): {"path",
        "step", "total_steps", "bytes", "seconds"}, and with ``path`` None the file's bytes as ``data`` instead of
        writing them; {"error"} when the file cannot be written; None when this
        rank holds no state of the request (not prepared yet, or ended) or is not its replica's writer."""
        state = self.step_states.get(request_id)
        if state is None or not self.writes_checkpoints:
            return None
        try:
            return step_checkpoint.save(state, path, self.model_info)
        except (OSError, step_checkpoint.CheckpointError) as exc:
            log.warning("checkpoint of %s to %s failed: %s", request_id, path, exc)
            return {"error": f"checkpoint of {request_id} to {path}: {getattr(exc, 'strerror', None) or exc}"}

    def _save_denoised(self, state: StepRequestState) -> None:
        """The denoised state to ``request.save_denoised_to`` before the decode (a failed write is logged: the
        request goes on)."""
        path = state.request.save_denoised_to
        if path is None or not self.writes_checkpoints:
            return
        try:
            step_checkpoint.save(state, path, self.model_info)
        except (OSError, step_checkpoint.CheckpointError) as exc:
            log.warning("denoised checkpoint of %s to %s failed: %s", state.request_id, path, exc)

    def _tick(self, states: list[StepRequestState]) -> dict[str, RunnerOutput]:
        try:
            with (self._compile_scope([st.request for st in states], any(st.cache is not None for st in states)),
                  block_cache.session(self.adapter, block_cache.step_rows(states))):
                preds = self.adapter.denoise_step(states)
        except Exception as exc:
            if isinstance(exc, WorkerFatalError):
                raise
            if len(states) == 1:
                return {states[0].request_id: self._step_error(states[0].request_id, exc)}
            results: dict[str, RunnerOutput] = {}
            for state in states:            # isolate the failing request; the others still advance
                results.update(self._tick([state]))
            return results
        results = {}
        for state, pred in zip(states, preds, strict=True):
            try:
                self.adapter.noise_step(state, pred)
            except Exception as exc:
                results[state.request_id] = self._step_error(state.request_id, exc)
                continue
            if state.finished:
                self._save_denoised(state)
            results[state.request_id] = self._advanced(state)
        return results

    def _advanced(self, state: StepRequestState) -> RunnerOutput:
        """The output of a state that just took a step (or resumed denoised): decoded when it is done (or a preview
        is due)."""
        rid = state.request_id
        try:
            if state.finished:
                report_phase(self.progress_hook, [rid], state.step_index, state.request.num_steps, "decode")
                decoded = Decoded.of(self.adapter.decode(state))
            elif state.request.preview_at(state.step_index):
                decoded = Decoded(self.adapter.post_decode(state))   # a preview (preview_every, partial_images)
            else:
                decoded = Decoded(None)
            result = RunnerOutput(rid, images=decoded.images, audio=decoded.audio, step_index=state.step_index,
                                  finished=state.finished, cache=None if state.cache is None else state.cache.counts())
            if state.finished:
                del self.step_states[rid]
            return result
        except Exception as exc:
            return self._step_error(rid, exc)

    def _adapters(self, *requests: DiffusionRequest):
        """The prompt cache's key gets the LoRA adapters of the requests being encoded, where a text encoder is
        adapted (Wan's adapters touch only its experts: its prompts' embeddings are the plain ones)."""
        if self.prompt_cache is None or not self.adapter.encoder_lora_components:
            return contextlib.nullcontext()
        return self.prompt_cache.adapters(tuple(tuple(adapter_identity(r)) for r in requests))

    def _new_cache(self, request: DiffusionRequest):
        return block_cache.new_cache(self.config.cache, request, self.model_info.block_cache_refusal)

    def num_cache_states(self) -> int:
        """Block-cache states held right now (step states with a cache; 0 between request-mode calls)."""
        return sum(1 for st in self.step_states.values() if st.cache is not None)

    # -- preempted step states -----------------------------------------------------------------------
    def _park(self, request_id: str) -> None:
        """Preempted: keep the state; copy it to the host when the byte bound allows."""
        state = self.step_states.get(request_id)
        if state is None or request_id in self.parked:
            return
        nbytes, bound = state.tensors_nbytes(), self.config.scheduler.preempted_offload_max_bytes
        if bound and self.parked_bytes() + nbytes <= bound:
            state.move_to(torch.device("cpu"))
            self.parked[request_id] = nbytes
        else:
            self.parked[request_id] = 0

    def _unpark(self, request_id: str) -> None:
        if self.parked.pop(request_id, 0):
            self.step_states[request_id].move_to(self.device)

    def parked_bytes(self) -> int:
        return sum(self.parked.values())

    def _drop_state(self, request_id: str) -> None:
        self.step_states.pop(request_id, None)
        self.parked.pop(request_id, None)

    def _step_error(self, request_id: str, exc: Exception) -> RunnerOutput:
        if isinstance(exc, WorkerFatalError):
            raise exc
        self._drop_state(request_id)
        log.warning("request %s failed: %s: %s", request_id, type(exc).__name__, str(exc))   # (a str: no tensors kept)
        return RunnerOutput.failed(request_id, exc)

    def _lora_guard(self, requests: list[DiffusionRequest]):
        """While a request with adapters is in the call, every adapted module must find its rows set."""
        if self.adapter.loras is None:
            return contextlib.nullcontext()
        return self.adapter.loras.guard(any(r.sampling.loras for r in requests))

    def _compile_scope(self, requests: list[DiffusionRequest], cached: bool):
        """Eager for this call when LoRA rows must act inside the compiled denoiser, or the block cache must skip
        blocks inside a fully compiled one; otherwise the compiled graphs run."""
        if self.compiler is None:
            return contextlib.nullcontext()
        reason = self.compiler.eager_reason(requests, self.adapter.loras, cached)
        return contextlib.nullcontext() if reason is None else self.compiler.eager(reason)

    def weight_stats(self) -> dict:
        return {"method": "none", "components": {}, "bytes": 0} if self.weights is None else self.weights.as_dict()

    def compile_stats(self) -> dict:
        return {"mode": "none"} if self.compiler is None else self.compiler.stats()

    def compile_warmup(self, budget_s: float | None = None) -> dict:
        return {"mode": "none"} if self.compiler is None else self.compiler.begin_warmup(budget_s)

    def compile_warmed(self) -> dict:
        return {"mode": "none"} if self.compiler is None else self.compiler.warmed()

    # -- bookkeeping -----------------------------------------------------------------------------------
    def num_request_states(self) -> int:
        """Per-request state this runner holds right now (0 between calls in request mode)."""
        return len(self.step_states) + (0 if self._active is None else len(self._active.request_ids))

    def offload_stats(self) -> dict:
        """The offloader's accounting (resident bytes per tier, transfers), or ``{"mode": "none"}``."""
        return {"mode": "none"} if self.offloader is None else self.offloader.stats()

    def close(self) -> None:
        if self.compiler is not None:
            self.compiler.close()
            self.compiler = None
        if self.offloader is not None:
            self.offloader.close()
            self.offloader = None
        self.adapter = self.prompt_cache = None
        self._active = None
        self.step_states.clear()
        self.parked.clear()
