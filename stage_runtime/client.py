"""StageClient: an asyncio client for a stage's ZMQ endpoint (DEALER → the stage's ROUTER, msgpack).

    async with StageClient("tcp://127.0.0.1:5570") as client:
        out = await client.generate("a cat", num_inference_steps=10, seed=1)    # DiffusionOutput, uint8 images
        stream = await client.add_request("a dog", stream=True)                # progress items, then the final
        async for item in stream: ...
        await client.abort(["id"]) ; await client.health() ; await client.collective_rpc("ping")

Results are routed by request id (RPC replies by rpc id), so many requests — and many clients — run at
once. A failed request raises the error tree's exception from :meth:`ClientStream.result`
(QueueFullError, RequestAbortedError, EngineDeadError, InvalidRequestError…). When the connection to the
stage drops (the process was killed), every request and RPC in flight fails with EngineDeadError instead
of waiting forever: the stage's state died with it. Message shapes: :mod:`stage_runtime.serve.wire`.
No torch here.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from stage_runtime.errors import EngineDeadError
from stage_runtime.outputs import DiffusionOutput
from stage_runtime.serve.wire import exception_from_message, output_from_message, pack, unpack

log = logging.getLogger(__name__)
CLOSE_LINGER_MS = 500      # how long close() may wait for queued messages to reach a stage that is there


class ClientStream:
    """One request's items as they arrive; the last one has ``finished=True``."""

    def __init__(self, client: StageClient, request_id: str):
        self.client = client
        self.request_id = request_id
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.finished = False

    def _put(self, message: dict[str, Any]) -> None:
        self._queue.put_nowait(message)

    async def _next_message(self, timeout: float | None) -> dict[str, Any]:
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            raise TimeoutError(f"no output for request {self.request_id} within {timeout} s") from None

    async def get(self, timeout: float | None = None) -> DiffusionOutput:
        message = await self._next_message(timeout)
        out = output_from_message(message)
        self.finished = out.finished
        return out

    async def __aiter__(self):
        while not self.finished:
            yield await self.get()

    async def result(self, timeout: float | None = None) -> DiffusionOutput:
        """The final output; raises the matching error for a failed, aborted or refused request."""
        while True:
            message = await self._next_message(timeout)
            if message["type"] == "error":
                self.finished = True
                raise exception_from_message(message)
            out = output_from_message(message)
            if out.finished:
                self.finished = True
                return out

    async def abort(self) -> dict[str, list[str]]:
        return await self.client.abort([self.request_id])


class StageClient:
    def __init__(self, address: str):
        self.address = address
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._streams: dict[str, ClientStream] = {}
        self._rpcs: dict[str, asyncio.Future] = {}
        self._rpc_ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._recv_task: asyncio.Task | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._monitor_task: asyncio.Task | None = None

    async def __aenter__(self) -> StageClient:
        self.connect()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    def connect(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)   # close() flushes what was sent (a shutdown), briefly
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(self.address)
        self._sock = sock
        self._recv_task = asyncio.create_task(self._receive())
        self._monitor_task = asyncio.create_task(self._watch_connection())

    async def _watch_connection(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._fail_in_flight(f"lost the connection to the stage at {self.address}; "
                                     "its requests in flight are gone")

    def _fail_in_flight(self, reason: str) -> None:
        streams, self._streams = self._streams, {}
        for rid, stream in streams.items():
            stream._put({"type": "error", "request_id": rid, "error": reason,
                         "error_type": EngineDeadError.error_type})
        rpcs, self._rpcs = self._rpcs, {}
        for future in rpcs.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))

    async def _receive(self) -> None:
        while True:
            payload = await self._sock.recv()
            try:
                message = unpack(payload)
            except (ValueError, TypeError) as exc:
                log.warning("undecodable message from the stage: %s", exc)
                continue
            self._route(message)

    def _route(self, message: dict[str, Any]) -> None:
        rid, rpc_id = message.get("request_id"), message.get("rpc_id")
        if rid is not None and message["type"] in ("result", "error"):
            stream = self._streams.get(rid)
            if stream is None:
                log.debug("message for unknown request %s dropped", rid)
                return
            if message["type"] == "error" or message.get("finished"):
                del self._streams[rid]
            stream._put(message)
        elif rpc_id is not None:
            future = self._rpcs.pop(rpc_id, None)
            if future is None or future.done():
                return
            if message["type"] == "error":
                future.set_exception(exception_from_message(message))
            else:
                future.set_result(message)
        else:
            log.warning("stage message without request or rpc id: %s", message)

    async def _send(self, message: dict[str, Any]) -> None:
        if self._sock is None:
            raise RuntimeError("StageClient is not connected (use 'async with' or connect())")
        await self._sock.send(pack(message))

    async def _call(self, message: dict[str, Any], timeout: float | None) -> dict[str, Any]:
        rpc_id = f"{self._prefix}-{next(self._rpc_ids)}"
        future = self._rpcs[rpc_id] = asyncio.get_running_loop().create_future()
        await self._send({**message, "rpc_id": rpc_id})
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise TimeoutError(f"{message['type']} got no answer within {timeout} s") from None
        finally:
            self._rpcs.pop(rpc_id, None)

    # -- requests ---------------------------------------------------------------------------------------
    async def add_request(self, prompt: str, request_id: str | None = None, **sampling: Any) -> ClientStream:
        """Send one request (``sampling``: SamplingParams fields, e.g. ``stream=True``); returns its stream."""
        rid = request_id or f"zmq-{uuid.uuid4().hex}"
        if rid in self._streams:
            raise ValueError(f"request_id={rid!r} is already in flight on this client")
        stream = self._streams[rid] = ClientStream(self, rid)
        await self._send({"type": "add_request", "request_id": rid, "prompt": prompt, "sampling_params": sampling})
        return stream

    async def generate(self, prompt: str, request_id: str | None = None, timeout: float | None = None,
                       **sampling: Any) -> DiffusionOutput:
        stream = await self.add_request(prompt, request_id, **sampling)
        return await stream.result(timeout)

    async def abort(self, request_ids: list[str] | None = None, all: bool = False,
                    timeout: float | None = 10.0) -> dict[str, list[str]]:
        message: dict[str, Any] = {"type": "abort", "all": True} if all else {"type": "abort",
                                                                              "request_ids": list(request_ids or [])}
        return (await self._call(message, timeout))["result"]

    # -- control ----------------------------------------------------------------------------------------
    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                             timeout: float | None = None, unique_reply_rank: int | None = None) -> Any:
        message = {"type": "collective_rpc", "method": method, "args": list(args), "kwargs": kwargs or {},
                   "timeout": timeout, "unique_reply_rank": unique_reply_rank}
        return (await self._call(message, None if timeout is None else timeout + 5.0))["result"]

    async def health(self, timeout: float | None = 5.0) -> dict[str, Any]:
        """``{"healthy", "state", "reason"}``."""
        reply = await self._call({"type": "health"}, timeout)
        return {k: reply.get(k) for k in ("healthy", "state", "reason")}

    async def shutdown(self) -> None:
        """Ask the stage to drain and exit (the same as SIGTERM)."""
        await self._send({"type": "shutdown"})

    async def close(self) -> None:
        for task in (self._recv_task, self._monitor_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._recv_task = self._monitor_task = None
        if self._sock is not None:
            self._sock.disable_monitor()
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None
        for future in self._rpcs.values():
            future.cancel()
        self._rpcs.clear()
        if self._sock is not None:
            self._sock.close()                       # with CLOSE_LINGER_MS: queued messages still leave
            self._sock = None
        self._ctx.term()
