"""WorkerProc: one rank's process — its IPC loop around a DiffusionWorker, and the reply rules.

    engine process                                 WorkerProc (rank r, spawned)
    MultiprocExecutor ── XPUB broadcast ─────────▶ SUB   → inbox → handle(RpcMessage)
                      ◀── PULL (one per rank) ──── PUSH  ← replies (main thread)
                                                         ← OUTPUT_READY (output thread)
                      ─── ready pipe ◀──────────── {"status": "ready"} | {"status": "error", ...}
                      ─── alive pipe ────────────▶ EOF = the engine process is gone → exit now

Lifecycle: connect, init device (+ torch.distributed when the world has more than one rank), load
the model, apply the parallel plan, report ready; then execute messages in broadcast order until
SHUTDOWN. Request-mode model calls answer twice (COMPUTE_DONE now, OUTPUT_READY from the output
thread). A failed collective is fatal: the rank reports it and exits 3, and the executor fails closed.
SIGTERM exits cleanly; SIGINT is left to the engine process (a terminal's Ctrl-C reaches all).
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import sys
import threading
import traceback
import uuid
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import zmq

from stage_runtime.config import StageConfig
from stage_runtime.errors import WorkerFatalError
from stage_runtime.executor import shm
from stage_runtime.executor.messages import (
    SHUTDOWN,
    CancelMessage,
    ComputeDone,
    ExecuteModel,
    Fatal,
    OutputReady,
    Progress,
    RpcMessage,
    RpcReply,
)
from stage_runtime.executor.wave import agree_stop
from stage_runtime.outputs import BatchRunnerOutput, ProgressEvent
from stage_runtime.scheduler_output import SchedulerOutput

log = logging.getLogger(__name__)
EXIT_FATAL = 3


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    config: StageConfig
    broadcast_addr: str
    result_addr: str
    shm_prefix: str
    init_method: str | None                  # torch.distributed rendezvous; None for a world of one
    environ: dict[str, str] | None = None    # the engine process's environment when the rank started


def worker_main(spec: WorkerSpec, ready_conn, alive_conn, proc_class: type[WorkerProc] | None = None) -> None:
    """Process entry point (forked from the fork server, or spawned); ``proc_class``: the executor's
    ``worker_proc_class`` (a WorkerProc subclass, e.g. a test's)."""
    if spec.environ is not None:              # a forked rank has the fork server's; give it the engine's
        os.environ.clear()
        os.environ.update(spec.environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    threading.Thread(target=_exit_with_parent, args=(alive_conn, spec), name="parent-watch", daemon=True).start()
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank{spec.rank} %(name)s: %(message)s")
    proc = (proc_class or WorkerProc)(spec)
    try:
        proc.start()
    except BaseException as exc:
        ready_conn.send({"status": "error", "error_type": type(exc).__name__, "message": str(exc),
                         "traceback": traceback.format_exc()})
        proc.close()
        raise SystemExit(1) from None
    ready_conn.send({"status": "ready", "pid": os.getpid()})
    ready_conn.close()
    try:
        proc.run()
    finally:
        proc.close()


def _exit_with_parent(alive_conn, spec: WorkerSpec) -> None:
    """Block on a pipe only the engine process writes to: EOF means it died (even by SIGKILL)."""
    try:
        alive_conn.recv()
    except (EOFError, OSError):
        pass
    shm.sweep(f"{spec.shm_prefix}r{spec.rank}-")
    os._exit(1)


class WorkerProc:
    shm_threshold: ClassVar[int] = shm.SHM_THRESHOLD     # images over this many bytes leave through shared memory

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.rank = spec.rank
        self.shm = shm.ShmWriter(spec.shm_prefix, spec.rank, self.shm_threshold)
        self.inbox: deque[Any] = deque()
        self.cancelled: set[str] = set()            # request ids of the model call in flight
        self.current_rpc: int | None = None
        self.padding = False                         # this call computes another rank's request (a DLO wave)
        self._send_lock = threading.Lock()
        self._outputs: queue.Queue = queue.Queue()
        self._ctx = zmq.Context()
        self.sub = self._ctx.socket(zmq.SUB)
        self.push = self._ctx.socket(zmq.PUSH)
        self.worker = None
        self._output_thread: threading.Thread | None = None

    def start(self) -> None:
        from stage_runtime.worker.worker import DiffusionWorker  # torch + diffusers: only in the rank

        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(self.spec.broadcast_addr)
        self.push.connect(self.spec.result_addr)
        self.worker = DiffusionWorker(self.spec.config, rank=self.rank, init_method=self.spec.init_method,
                                      progress_hook=self._on_progress)
        self.worker.init_device()
        self.worker.load_model()
        self._output_thread = threading.Thread(target=self._output_loop, name="output", daemon=True)
        self._output_thread.start()

    # -- the loop --------------------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            msg = self.inbox.popleft() if self.inbox else pickle.loads(self.sub.recv())
            if msg == SHUTDOWN:
                return
            if isinstance(msg, (ExecuteModel, RpcMessage)):
                self.handle(msg)
            # a CancelMessage seen here is stale: its model call already finished

    def handle(self, msg: ExecuteModel | RpcMessage) -> None:
        """Run one message; answer as the reply rules say (messages.py)."""
        if isinstance(msg, ExecuteModel):
            replying = self.worker.groups.is_replica_leader
        else:
            replying = msg.reply_rank is None or msg.reply_rank == self.rank
            if not replying:
                return
        try:
            result = self._execute(msg)
        except Exception as exc:
            if isinstance(exc, WorkerFatalError):
                self._fatal(f"rank {self.rank}: {type(exc).__name__}: {exc}")
            if replying:
                self._send(RpcReply(msg.rpc_id, self.rank, ok=False, error=f"{type(exc).__name__}: {exc}",
                                    traceback=traceback.format_exc()))
            return
        if not replying:
            return
        if isinstance(msg, ExecuteModel) and msg.sched_out.mode == "request":
            self._send_compute_done(msg.rpc_id, result)
        else:
            self._send(RpcReply(msg.rpc_id, self.rank, result=self.shm.pack(result)))

    def _execute(self, msg: ExecuteModel | RpcMessage) -> Any:
        if isinstance(msg, RpcMessage):
            return self.worker.control_rpc(msg.method, msg.args, msg.kwargs)
        sched_out = self._my_share(msg.sched_out, msg.dp_assign)
        pad = (msg.dp_pad or {}).get(self.worker.groups.dp_rank)
        if pad is not None:        # a DLO wave left this rank without a request: compute a copy, drop its result
            sched_out = replace(sched_out, scheduled_new_reqs=[n for n in msg.sched_out.scheduled_new_reqs
                                                               if n.request_id == pad])
        self.current_rpc, self.cancelled, self.padding = msg.rpc_id, set(), pad is not None
        try:
            result = self.worker.execute_model(sched_out)
            return BatchRunnerOutput() if self.padding else result
        finally:
            self.current_rpc, self.padding = None, False

    def _my_share(self, sched_out: SchedulerOutput, dp_assign: dict[str, int] | None) -> SchedulerOutput:
        """The requests the executor placed on this rank's DP replica (all of them without DP)."""
        if dp_assign is None:
            return sched_out
        dp = self.worker.groups.dp_rank
        new = [n for n in sched_out.scheduled_new_reqs if dp_assign.get(n.request_id) == dp]
        cached = [rid for rid in sched_out.scheduled_cached_req_ids if dp_assign.get(rid) == dp]
        return replace(sched_out, scheduled_new_reqs=new, scheduled_cached_req_ids=cached)

    # -- request mode: progress out, cancels in, agreed by the replica ---------------------------------
    def _on_progress(self, event: ProgressEvent) -> set[str]:
        groups = self.worker.groups
        if groups.is_replica_leader and self.current_rpc is not None and not self.padding:
            self._send(Progress(self.current_rpc, self.rank, event.request_ids, event.step_index, event.num_steps,
                                event.phase))
        if event.phase != "denoise":
            return set()           # a phase notice: cancels are agreed at denoising steps only (symmetric there)
        self._drain_broadcast()
        if self.spec.config.offload.dlo:             # lock-step waves: stop only when every rank stops
            return agree_stop(groups, self.cancelled, event.request_ids, self.worker.device)
        return agree(groups, self.cancelled)

    def _drain_broadcast(self) -> None:
        """Read what arrived without blocking; keep RPCs for the loop, apply cancels for this call."""
        while self.sub.poll(0):
            msg = pickle.loads(self.sub.recv())
            if isinstance(msg, CancelMessage):
                if msg.rpc_id == self.current_rpc:
                    self.cancelled.update(msg.request_ids)
            else:
                self.inbox.append(msg)

    # -- replies ---------------------------------------------------------------------------------------
    def _send(self, msg: Any) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self.push.send(data)

    def _send_compute_done(self, rpc_id: int, result: BatchRunnerOutput) -> None:
        """COMPUTE_DONE now; the output thread packs large images into shared memory and sends them as
        OUTPUT_READY (their outputs carry async ids). Images up to the shm threshold ride inline in
        COMPUTE_DONE: one message, no extra hop, where packing would cost nothing worth hiding."""
        batch_id, images, stripped = uuid.uuid4().hex, {}, BatchRunnerOutput()
        for rid, out in result.outputs.items():
            if out.images is not None and out.images.nbytes > self.shm.threshold:
                async_id = f"{batch_id}/{rid}"
                images[async_id] = out.images
                out = replace(out, images=None, async_output_id=async_id)
            stripped.outputs[rid] = out
        if images:
            self._outputs.put(images)
        self._send(ComputeDone(rpc_id, self.rank, result=stripped))

    def _output_loop(self) -> None:
        while (images := self._outputs.get()) is not None:
            self._send_outputs(images)

    def _send_outputs(self, images: dict[str, Any]) -> None:
        """One batch's large images (by async output id) into shared memory, then OUTPUT_READY (output thread)."""
        try:
            self._send(OutputReady(self.rank, {k: self.shm.put(v) for k, v in images.items()}))
        except Exception as exc:
            log.exception("packing outputs failed")
            self._send(OutputReady(self.rank, {}, error=f"{type(exc).__name__}: {exc}", failed_ids=tuple(images)))

    def _fatal(self, reason: str) -> None:
        log.error("fatal: %s", reason)
        try:
            self._send(Fatal(self.rank, reason))
        finally:                  # term() flushes the reason (up to the linger) before the hard exit
            self.sub.close(linger=0)
            self.push.close(linger=1000)
            self._ctx.term()
            os._exit(EXIT_FATAL)

    def close(self) -> None:
        self._outputs.put(None)
        if self._output_thread is not None:
            self._output_thread.join(5)
        if self.worker is not None:
            self.worker.shutdown()
        self.sub.close(linger=0)
        self.push.close(linger=1000)
        self._ctx.term()


def agree(groups, cancelled: set[str]) -> set[str]:
    """Every rank of a DP replica stops the same requests at the same step: the leader's set wins.

    One broadcast per denoising step, and only when the replica has more than one rank; without it a
    rank that saw a cancel one step earlier than its peers would leave them stranded in a collective.
    """
    if groups.replica_group is None:
        return set(cancelled)
    import torch.distributed as dist

    from stage_runtime.distributed.comm import guarded

    box = [sorted(cancelled)]
    guarded("broadcast_object_list(cancelled ids)", groups.replica_group,
            lambda: dist.broadcast_object_list(box, src=groups.replica_ranks[0], group=groups.replica_group))
    return set(box[0])
