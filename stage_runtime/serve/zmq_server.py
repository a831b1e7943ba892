"""The stage's ZMQ endpoint: a ROUTER socket (pyzmq asyncio) speaking the msgpack messages of
:mod:`stage_runtime.serve.wire`. Many DEALER clients at once; replies go back to the sender's identity,
keyed by request id / rpc id. A peer that is gone (unroutable: ROUTER_MANDATORY) has its request aborted.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Callable
from contextlib import aclosing
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stage_runtime.control import check_control_rpc
from stage_runtime.errors import DiffStageError, InvalidRequestError, RpcError
from stage_runtime.request import DiffusionRequest, SamplingParams
from stage_runtime.serve.service import StageService
from stage_runtime.serve.wire import error_message, output_message, pack, unpack

log = logging.getLogger(__name__)


class _AddRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: str
    request_id: str = Field(min_length=1, max_length=256)
    prompt: str
    sampling_params: dict[str, Any] = Field(default_factory=dict)


class ZmqServer:
    def __init__(self, service: StageService, host: str, port: int, on_shutdown: Callable[[str], None]):
        self.service = service
        self.host, self.port = host, port
        self.on_shutdown = on_shutdown
        self.ctx = zmq.asyncio.Context()
        self.sock: zmq.asyncio.Socket | None = None
        self.endpoint: str | None = None
        self._tasks: set[asyncio.Task] = set()

    def bind(self) -> str:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 1000)
        try:
            sock.bind(f"tcp://{self.host}:{self.port or '*'}")
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        self.sock = sock
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.endpoint

    async def serve(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            identity, payload = frames[0], frames[-1]
            try:
                message = unpack(payload)
            except (ValueError, TypeError, msgpack.UnpackException) as exc:
                log.warning("undecodable message from a client: %s", exc)
                await self._send(identity, error_message(InvalidRequestError("message", "<bytes>", str(exc))))
                continue
            self._dispatch(identity, message)

    def _dispatch(self, identity: bytes, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == "add_request":
            self._spawn(self._run_request(identity, msg))
        elif kind == "abort":
            result = self.service.abort(msg.get("request_ids"), all=bool(msg.get("all")))
            if msg.get("rpc_id") is not None:
                self._spawn(self._send(identity, {"type": "rpc_result", "rpc_id": msg["rpc_id"], "result": result}))
        elif kind == "collective_rpc":
            self._spawn(self._run_rpc(identity, msg))
        elif kind == "health":
            self._spawn(self._send(identity, {"type": "health_result", "rpc_id": msg.get("rpc_id"),
                                              "healthy": self.service.dead_reason is None,
                                              "state": self.service.state, "reason": self.service.dead_reason}))
        elif kind == "shutdown":
            self.on_shutdown("shutdown message over ZMQ")
        else:
            exc = InvalidRequestError("type", kind, "expected add_request, abort, collective_rpc, health or shutdown")
            self._spawn(self._send(identity, error_message(exc, msg.get("request_id"), msg.get("rpc_id"))))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("ZMQ task failed", exc_info=task.exception())

    async def _run_request(self, identity: bytes, msg: dict[str, Any]) -> None:
        rid = msg.get("request_id") if isinstance(msg.get("request_id"), str) else None
        try:
            try:
                parsed = _AddRequest.model_validate(msg)
            except ValidationError as exc:
                err = exc.errors(include_url=False)[0]
                raise InvalidRequestError(".".join(map(str, err["loc"])), err.get("input"), err["msg"]) from None
            request = DiffusionRequest(parsed.request_id, parsed.prompt, SamplingParams.parse(parsed.sampling_params))
            stream = self.service.submit(request)
        except DiffStageError as exc:
            await self._send(identity, error_message(exc, request_id=rid))
            return
        async with aclosing(self.service.outputs(stream)) as items:
            async for item in items:
                if not await self._send(identity, output_message(item)):
                    return                         # the client is gone: leaving the loop aborts the request

    async def _run_rpc(self, identity: bytes, msg: dict[str, Any]) -> None:
        rpc_id = msg.get("rpc_id")
        try:
            method = check_control_rpc(msg.get("method"))     # a closed set, checked before any thread hop
            result = await asyncio.to_thread(
                self.service.collective_rpc, method, tuple(msg.get("args") or ()), dict(msg.get("kwargs") or {}),
                msg.get("timeout"), msg.get("unique_reply_rank"))
            reply = pack({"type": "rpc_result", "rpc_id": rpc_id, "result": result})
        except DiffStageError as exc:
            await self._send(identity, error_message(exc, rpc_id=rpc_id))
            return
        except Exception as exc:                   # the worker method's own failure, or an unencodable result
            await self._send(identity, error_message(RpcError(f"{type(exc).__name__}: {exc}"), rpc_id=rpc_id))
            return
        await self._send_raw(identity, reply)

    async def _send(self, identity: bytes, message: dict[str, Any]) -> bool:
        return await self._send_raw(identity, pack(message))

    async def _send_raw(self, identity: bytes, payload: bytes) -> bool:
        """False when the peer is gone (ROUTER_MANDATORY makes that an error instead of a silent drop)."""
        try:
            await self.sock.send_multipart([identity, payload])
            return True
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:
                return False
            raise

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.sock is not None:
            self.sock.close(linger=500)
        self.ctx.term()
