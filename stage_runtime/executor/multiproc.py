"""MultiprocExecutor (``mp``): one spawned WorkerProc per rank; fails closed when any of them dies.

    engine thread ──RpcMessage──▶ XPUB ══broadcast══▶ rank 0 … rank N-1 (SUB)
    result pump   ◀─────────────── PULL[r] ◀════════ rank r (PUSH)          one channel per rank
    monitor       waits on every rank's process sentinel → mark_dead(reason) → terminate the rest

Startup: bind the sockets, spawn the ranks, wait for every ready message (or the first rank that
fails or exits, or the startup timeout: each names the rank and the cause), then for every rank's
subscription to reach the broadcast socket. Model calls go to every rank; each DP replica's leader
answers for the requests placed on its replica. Request mode answers COMPUTE_DONE first; images over
the shared-memory threshold follow as OUTPUT_READY (``wait_output_ready``). Worker death: every
pending call and output fails with EngineDeadError naming the rank and its exit, health fails, the
other ranks are terminated; a dead group is never reused. Shutdown is idempotent and leaves no
process, socket file or /dev/shm segment.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import secrets
import shutil
import signal
import tempfile
import threading
import time
import weakref
from dataclasses import replace
from typing import Any

import zmq

from stage_runtime.errors import (ConfigError, EngineClosedError, EngineDeadError, EngineStartupError, ModelLoadError,
                                  RpcError, by_name)
from stage_runtime.executor import shm
from stage_runtime.executor.abstract import DiffusionExecutor
from stage_runtime.executor.async_output import AsyncOutputTable
from stage_runtime.executor.messages import (SHUTDOWN, CancelMessage, ExecuteModel, Fatal, Progress, RpcMessage,
                                             RpcReply)
from stage_runtime.executor.placement import DataParallelPlacement
from stage_runtime.executor.procs import (
    KILL_GRACE_S,
    describe_exit,
    free_port,
    join_all,
    last_resort,
    recv_or_none,
    signal_all,
    worker_context,
)
from stage_runtime.executor.result_pump import ResultPump
from stage_runtime.executor.wave import WavePlacement, wave_refusal
from stage_runtime.executor.worker_proc import EXIT_FATAL, WorkerProc, WorkerSpec, worker_main
from stage_runtime.outputs import BatchRunnerOutput, ProgressEvent, RunnerOutput
from stage_runtime.scheduler_output import SchedulerOutput

log = logging.getLogger(__name__)
JOIN_GRACE_S = 5.0
FATAL_REASON_WAIT_S = 0.5
DEAD_GRACE_S = 0.5


class MultiprocExecutor(DiffusionExecutor):
    worker_proc_class: type[WorkerProc] = WorkerProc     # what each rank runs (a subclass may change how it replies)

    def _init_executor(self) -> None:
        parallel = self.config.parallel
        self.world_size = parallel.world_size
        self.leader_ranks = [rc.rank for rc in parallel.rank_layout() if rc.tp == rc.sp == rc.pp == rc.cfg == 0]
        self.shm_prefix = f"ds-{os.getpid()}-{secrets.token_hex(3)}-"
        self.procs: list[multiprocessing.Process] = []
        self._alive_conns: list = []
        self._rpc_ids = itertools.count(1)
        self._send_lock = threading.Lock()
        self.waves = self.config.offload.dlo          # lock-step waves over the dp ranks (executor.wave)
        self.placement = (WavePlacement if self.waves else DataParallelPlacement)(len(self.leader_ranks))
        self._fatal: dict[int, str] = {}
        self._stopping = threading.Event()
        self._stop_r, self._stop_w = multiprocessing.Pipe(duplex=False)
        self.outputs = AsyncOutputTable(self._on_output)
        self._ipc_dir = tempfile.mkdtemp(prefix="ds-ipc-")
        self._ctx = zmq.Context()
        self._bcast = self._ctx.socket(zmq.XPUB)
        self._bcast.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._bcast.bind(f"ipc://{self._ipc_dir}/bcast")
        self._results = [self._ctx.socket(zmq.PULL) for _ in range(self.world_size)]
        for rank, sock in enumerate(self._results):
            sock.bind(f"ipc://{self._ipc_dir}/result-{rank}")
        self.pump = ResultPump(self._results, self.outputs, self._on_worker_progress, self._on_worker_fatal)
        weakref.finalize(self, last_resort, self.procs, self.shm_prefix, self._ipc_dir)
        try:
            self._start_workers()
            self.pump.start()
            self._monitor = threading.Thread(target=self._watch_workers, name="worker-monitor", daemon=True)
            self._monitor.start()
        except BaseException:
            self._closed = True
            self._shutdown_workers()
            raise

    # -- startup ---------------------------------------------------------------------------------------
    def _start_workers(self) -> None:
        ctx = worker_context(self.config.worker_start_method)
        init_method = f"tcp://127.0.0.1:{free_port()}" if self.world_size > 1 else None
        ready: dict[int, Any] = {}
        for rank in range(self.world_size):
            ready_r, ready_w = ctx.Pipe(duplex=False)
            alive_r, alive_w = ctx.Pipe(duplex=False)
            spec = WorkerSpec(rank, self.config, f"ipc://{self._ipc_dir}/bcast", f"ipc://{self._ipc_dir}/result-{rank}",
                              self.shm_prefix, init_method, dict(os.environ))
            proc = ctx.Process(target=worker_main, args=(spec, ready_w, alive_r, self.worker_proc_class),
                               name=f"DiffusionWorker-{rank}", daemon=True)
            proc.start()
            ready_w.close()
            alive_r.close()
            self.procs.append(proc)
            self._alive_conns.append(alive_w)
            ready[rank] = ready_r
        self._wait_ready(ready)
        self._wait_subscribed()

    def _wait_ready(self, ready: dict[int, Any]) -> None:
        timeout = self.config.worker_startup_timeout_s
        deadline = time.monotonic() + timeout
        while ready:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineStartupError(f"worker rank(s) {sorted(ready)} not ready within "
                                         f"worker_startup_timeout_s={timeout:g} s")
            owner = {id(conn): rank for rank, conn in ready.items()}
            owner.update({id(self.procs[rank].sentinel): rank for rank in ready})
            for obj in multiprocessing.connection.wait(list(ready.values()) + [self.procs[r].sentinel for r in ready],
                                                       left):
                rank = owner[id(obj)]
                if rank not in ready or (obj is not ready[rank] and ready[rank].poll()):
                    continue                # a rank that exited after writing: read its message first
                msg = recv_or_none(ready.pop(rank))
                if msg is None or msg["status"] != "ready":
                    self._raise_startup_failure(rank, msg)

    def _raise_startup_failure(self, rank: int, msg: dict | None) -> None:
        proc = self.procs[rank]
        if msg is None:
            proc.join(JOIN_GRACE_S)
            raise EngineStartupError(f"worker {describe_exit(rank, proc.pid, proc.exitcode)} during startup")
        # The rank names its error's class: a permanent one (configuration, the model: exit 2) is raised as that
        # class of the tree, anything else as a failed startup.
        sent = by_name(msg["error_type"])
        permanent = sent is not None and issubclass(sent, (ConfigError, ModelLoadError))
        error_cls = sent if permanent else EngineStartupError
        log.error("worker rank %d failed to start:\n%s", rank, msg.get("traceback", ""))
        raise error_cls(f"worker rank {rank} (pid {proc.pid}) failed to start: {msg['error_type']}: {msg['message']}")

    def _wait_subscribed(self) -> None:
        """XPUB sees one subscription per SUB: after this, no broadcast can be lost to a slow joiner."""
        seen, deadline = 0, time.monotonic() + self.config.worker_startup_timeout_s
        while seen < self.world_size:
            if not self._bcast.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                raise EngineStartupError(f"only {seen} of {self.world_size} worker ranks subscribed to the broadcast")
            if self._bcast.recv()[:1] == b"\x01":
                seen += 1

    # -- RPC -------------------------------------------------------------------------------------------
    def _collective_rpc(self, method: str, args: tuple, kwargs: dict, timeout: float | None,
                        unique_reply_rank: int | None) -> Any:
        """Every rank runs it and answers with its status (``unique_reply_rank`` None), or rank
        ``unique_reply_rank`` alone runs and answers. Any failed rank raises RpcError."""
        ranks = list(range(self.world_size)) if unique_reply_rank is None else [unique_reply_rank]
        replies = self._call(RpcMessage(0, method, args, kwargs, unique_reply_rank), ranks, timeout)
        failed = [r for r in replies.values() if not r.ok]
        if failed:
            detail = "; ".join(f"rank {r.rank}: {r.error}" for r in failed)
            for r in failed:
                log.error("RPC %r failed on rank %d:\n%s", method, r.rank, r.traceback)
            raise RpcError(f"RPC {method!r} failed on worker rank(s) {[r.rank for r in failed]}: {detail}")
        if unique_reply_rank is not None:
            return replies[unique_reply_rank].result
        return [replies[rank].result for rank in ranks]

    def execute_model(self, sched_out: SchedulerOutput) -> BatchRunnerOutput:
        refusal = wave_refusal(sched_out) if self.waves else None
        if refusal is not None:                # refused whole, before any rank runs it
            return BatchRunnerOutput({rid: RunnerOutput(rid, error=f"InvalidWave: {refusal}")
                                      for rid in sched_out.scheduled_request_ids})
        assign = self.placement.place(sched_out)
        pad = self.placement.pads(sched_out) if self.waves else None
        replies = self._call(ExecuteModel(0, sched_out, assign, pad), self.leader_ranks, None)
        out = BatchRunnerOutput()
        for reply in replies.values():
            if reply.ok:
                out.outputs.update(reply.result.outputs)
            else:                      # that replica's requests fail; the other replicas' results stand
                log.error("%s-mode execution failed on rank %d:\n%s", sched_out.mode, reply.rank, reply.traceback)
                mine = [rid for rid in sched_out.scheduled_request_ids
                        if assign is None or assign[rid] == self._dp_index(reply.rank)]
                out.outputs.update({rid: RunnerOutput(rid, error=reply.error) for rid in mine})
        self.placement.release(sched_out, out)
        return out

    def _call(self, msg: RpcMessage | ExecuteModel, ranks: list[int], timeout: float | None) -> dict[int, RpcReply]:
        self.check_health()
        msg = replace(msg, rpc_id=next(self._rpc_ids))
        future = self.pump.expect(msg.rpc_id, ranks)
        self._broadcast(msg)
        try:
            return future.result(timeout)
        except TimeoutError:
            self.pump.forget(msg.rpc_id)
            what = f"RPC {msg.method!r}" if isinstance(msg, RpcMessage) else "model execution"
            reason = f"{what} got no answer from rank(s) {ranks} within {timeout} s"
            self.mark_dead(reason)    # the ranks are out of step with the broadcast: never reuse them
            raise EngineDeadError(reason) from None

    def _broadcast(self, msg: Any) -> None:
        data = msg if isinstance(msg, bytes) else pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self._bcast.send(data)

    def _dp_index(self, leader_rank: int) -> int:
        return self.leader_ranks.index(leader_rank)

    # -- async output ----------------------------------------------------------------------------------
    def claim_output(self, async_output_id: str) -> None:
        self.outputs.claim(async_output_id)

    def drop_output(self, async_output_id: str) -> None:
        self.outputs.drop(async_output_id)

    def _on_output(self, async_output_id: str, images: Any, error: str | None) -> None:
        hook = self._output_hook
        if hook is not None:
            hook(async_output_id, images, error)

    def num_pending(self) -> int:
        """Bookkeeping held for calls and outputs in flight (0 when idle)."""
        return self.pump.num_pending() + len(self.outputs) + len(self.placement)

    # -- progress and cancel (request mode) --------------------------------------------------------------
    def _on_worker_progress(self, p: Progress) -> None:
        cancel = self.on_progress(ProgressEvent(p.request_ids, p.step_index, p.num_steps, p.phase))
        if cancel:
            self._broadcast(CancelMessage(p.rpc_id, tuple(sorted(cancel))))

    def _on_worker_fatal(self, fatal: Fatal) -> None:
        self._fatal[fatal.rank] = fatal.reason

    # -- health and failure ----------------------------------------------------------------------------
    def _watch_workers(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs)}
        fired = multiprocessing.connection.wait(list(sentinels) + [self._stop_r])
        if self._stopping.is_set() or self._stop_r in fired:
            return
        # the first rank to go is the cause; peers that then failed a collective report Fatal and exit 3
        rank = min((rank in self._fatal, rank) for s, rank in sentinels.items() if s in fired)[1]
        proc = self.procs[rank]
        proc.join(1.0)
        reason = describe_exit(rank, proc.pid, proc.exitcode)
        if proc.exitcode == EXIT_FATAL:          # it sent its reason just before exiting: let the pump read it
            deadline = time.monotonic() + FATAL_REASON_WAIT_S
            while rank not in self._fatal and time.monotonic() < deadline:
                time.sleep(0.01)
        if rank in self._fatal:
            reason = f"{reason}: {self._fatal[rank]}"
        self.mark_dead(f"worker {reason}")

    def check_health(self) -> None:
        super().check_health()
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():       # the monitor latches it within milliseconds; answer now
                raise EngineDeadError(f"worker {describe_exit(rank, proc.pid, proc.exitcode)}")

    def mark_dead(self, reason: str) -> None:
        """Fail closed: latch, fail every pending call and output, then stop the remaining ranks."""
        first = self._dead_reason is None
        super().mark_dead(reason)
        if first:
            self.pump.fail_all(EngineDeadError(reason))
            self._stop_workers()

    def workers(self) -> list[dict[str, Any]]:
        return [{"rank": rank, "pid": p.pid, "alive": p.is_alive()} for rank, p in enumerate(self.procs)]

    # -- shutdown --------------------------------------------------------------------------------------
    def _stop_workers(self) -> None:
        """SHUTDOWN to every rank; after a grace period SIGTERM, then SIGKILL. Safe to call twice.

        A dead group gets no SHUTDOWN and a short SIGTERM grace: its ranks may sit in a collective that
        never completes, and the stage process must be able to exit 3 within its own deadline.
        """
        if not self._stopping.is_set():
            self._stopping.set()
            self._stop_w.send(b"")
        dead = self._dead_reason is not None
        live = [p for p in self.procs if p.is_alive()]
        if live and not dead:
            self._broadcast(pickle.dumps(SHUTDOWN))
            join_all(live, JOIN_GRACE_S)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            live = [p for p in self.procs if p.is_alive()]
            signal_all(live, sig)
            join_all(live, DEAD_GRACE_S if dead else KILL_GRACE_S)

    def _shutdown_workers(self) -> None:
        self._stop_workers()
        self.pump.stop()
        self.pump.fail_all(EngineClosedError("DiffusionExecutor is shut down."))
        for conn in [*self._alive_conns, self._stop_r, self._stop_w]:
            conn.close()
        for sock in [self._bcast, *self._results]:
            sock.close(linger=0)
        self._ctx.term()
        leaked = shm.sweep(self.shm_prefix)
        if leaked:
            log.warning("removed %d shared-memory segment(s) left by dead ranks", len(leaked))
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
