"""ResultPump: the one thread that reads every rank's result channel and routes what arrives.

    RpcReply / ComputeDone  → the pending RPC ``rpc_id``; its future resolves when every expected
                              rank has answered ({rank: reply}); replies nobody waits for are dropped
    OutputReady             → AsyncOutputTable (waiter, cache, or discard)
    Progress                → ``on_progress`` (the engine's step hook; it may broadcast a cancel)
    Fatal                   → ``on_fatal`` (remembered as the reason the rank is about to exit)

Shared-memory handles are unpacked (and so unlinked) on arrival, before routing: a message that nobody
wants still frees its segment. Futures are resolved outside the lock.
"""

from __future__ import annotations

import concurrent.futures
import logging
import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from stage_runtime.executor import shm
from stage_runtime.executor.async_output import AsyncOutputTable
from stage_runtime.executor.messages import Fatal, OutputReady, Progress, RpcReply

log = logging.getLogger(__name__)
POLL_MS = 50


@dataclass
class _Pending:
    future: concurrent.futures.Future
    ranks: set[int]
    replies: dict[int, RpcReply] = field(default_factory=dict)


class ResultPump(threading.Thread):
    def __init__(self, sockets: list[zmq.Socket], outputs: AsyncOutputTable,
                 on_progress: Callable[[Progress], None], on_fatal: Callable[[Fatal], None]):
        super().__init__(name="result-pump", daemon=True)
        self.sockets = sockets
        self.outputs = outputs
        self.on_progress = on_progress
        self.on_fatal = on_fatal
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._error: BaseException | None = None
        self._stop_event = threading.Event()

    def expect(self, rpc_id: int, ranks: list[int]) -> concurrent.futures.Future:
        """Register an RPC before broadcasting it: resolves with {rank: reply} once all ``ranks`` answer."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._error is not None:
                future.set_exception(self._error)
            else:
                self._pending[rpc_id] = _Pending(future, set(ranks))
        return future

    def forget(self, rpc_id: int) -> None:
        with self._lock:
            self._pending.pop(rpc_id, None)

    def run(self) -> None:
        poller = zmq.Poller()
        for sock in self.sockets:
            poller.register(sock, zmq.POLLIN)
        while not self._stop_event.is_set():
            for sock, _ in poller.poll(POLL_MS):
                while not self._stop_event.is_set():
                    try:
                        data = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.route(pickle.loads(data))

    def route(self, msg: object) -> None:
        if isinstance(msg, RpcReply):
            msg.result = shm.unpack(msg.result)
            self._on_reply(msg)
        elif isinstance(msg, OutputReady):
            failed = {aid: f"rank {msg.rank}: {msg.error}" for aid in msg.failed_ids}
            self.outputs.deliver(shm.unpack(msg.images), failed)
        elif isinstance(msg, Progress):
            self.on_progress(msg)
        elif isinstance(msg, Fatal):
            self.on_fatal(msg)
        else:
            log.error("unexpected message from a worker: %r", type(msg).__name__)

    def _on_reply(self, reply: RpcReply) -> None:
        with self._lock:
            pending = self._pending.get(reply.rpc_id)
            if pending is None or reply.rank not in pending.ranks:
                log.debug("dropping reply to rpc %s from rank %s (nobody waits for it)", reply.rpc_id, reply.rank)
                return
            pending.replies[reply.rank] = reply
            if len(pending.replies) < len(pending.ranks):
                return
            del self._pending[reply.rpc_id]
        if pending.future.set_running_or_notify_cancel():
            pending.future.set_result(pending.replies)

    def fail_all(self, error: BaseException) -> None:
        """Every pending and future RPC fails with ``error`` (the executor is dead or shut down)."""
        with self._lock:
            self._error = error
            pending, self._pending = self._pending, {}
        for p in pending.values():
            if p.future.set_running_or_notify_cancel():
                p.future.set_exception(error)
        self.outputs.fail_all(error)

    def num_pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(5)
