"""What both frontends speak: msgpack message shapes (ZMQ) and an error's type and status on the wire.

Client → stage (DEALER → ROUTER), one msgpack map per message, keyed by ``type``:
    add_request     {request_id, prompt, sampling_params: {SamplingParams fields}}
    abort           {request_ids: [...]} or {all: true}; with an rpc_id it is answered by an rpc_result
    collective_rpc  {rpc_id, method, args, kwargs, timeout, unique_reply_rank}
    health          {rpc_id}
    shutdown        {}                                  the same graceful drain as SIGTERM
Stage → client:
    result          {request_id, finished, images, step_index, num_steps, phase, metrics}   one per request, or
                    one per chunk when the request asked for ``stream`` (progress, previews, then final)
    error           {request_id | rpc_id, error, error_type, status_code[, param], step_index}  terminal for a
                    request (step_index: steps it ran, e.g. 0 for a deadline passed while queued)
    rpc_result      {rpc_id, result}
    health_result   {rpc_id, healthy, state, reason}
Images travel raw: {shape: [n, H, W, 3], dtype: "uint8", data: bytes}.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import msgpack
import numpy as np

from stage_runtime import errors
from stage_runtime.errors import DiffStageError, InvalidRequestError, RequestFailedError
from stage_runtime.outputs import DiffusionOutput


def error_type_of(exc: BaseException) -> str:
    """The wire type of an exception: its class's ``error_type`` (errors.py), ``internal_error`` for any other."""
    return getattr(exc, "error_type", None) or "internal_error"


def status_of(error_type: str) -> int:
    """The HTTP status of a wire type (the ZMQ ``error`` message carries it too): its class's, else 500."""
    cls = errors.by_type(error_type)
    return cls.http_status if cls is not None and cls.http_status is not None else 500


# -- msgpack ----------------------------------------------------------------------------------------------
def _default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, np.ndarray):
        return encode_array(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} in a message")


def pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True, default=_default)


def unpack(data: bytes) -> dict[str, Any]:
    message = msgpack.unpackb(data, raw=False)
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ValueError("a message must be a msgpack map with a string 'type'")
    return message


def encode_array(array: np.ndarray) -> dict[str, Any]:
    array = np.ascontiguousarray(array)
    return {"shape": list(array.shape), "dtype": str(array.dtype), "data": array.tobytes()}


def decode_array(obj: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(obj["data"], dtype=np.dtype(obj["dtype"])).reshape(obj["shape"])


# -- messages ---------------------------------------------------------------------------------------------
def result_message(out: DiffusionOutput) -> dict[str, Any]:
    return {"type": "result", "request_id": out.request_id, "finished": out.finished,
            "images": None if out.images is None else encode_array(out.images),
            "step_index": out.step_index, "num_steps": out.num_steps, "phase": out.phase, "metrics": out.metrics}


def output_message(out: DiffusionOutput) -> dict[str, Any]:
    """A stream item as a message: a terminal failure becomes an ``error``, anything else a ``result``."""
    if out.finished and out.error is not None:
        error_type = out.error_type or RequestFailedError.error_type
        return {"type": "error", "request_id": out.request_id, "error": out.error, "error_type": error_type,
                "status_code": status_of(error_type), "step_index": out.step_index, "metrics": out.metrics}
    return result_message(out)


def error_message(exc: BaseException, request_id: str | None = None, rpc_id: Any = None) -> dict[str, Any]:
    error_type = error_type_of(exc)
    msg: dict[str, Any] = {"type": "error", "error": str(exc) or type(exc).__name__, "error_type": error_type,
                           "status_code": status_of(error_type)}
    if request_id is not None:
        msg["request_id"] = request_id
    if rpc_id is not None:
        msg["rpc_id"] = rpc_id
    if isinstance(exc, InvalidRequestError):
        msg["param"], msg["reason"] = exc.field, exc.reason
        msg["value"] = exc.value if isinstance(exc.value, (str, int, float, bool, type(None))) else repr(exc.value)
    return msg


def output_from_message(msg: dict[str, Any]) -> DiffusionOutput:
    """Client side: a ``result`` or a request's ``error`` back into a DiffusionOutput."""
    if msg["type"] == "error":
        return DiffusionOutput(msg["request_id"], finished=True, error=msg["error"], error_type=msg["error_type"],
                               step_index=msg.get("step_index"), metrics=msg.get("metrics") or {})
    images = msg.get("images")
    return DiffusionOutput(msg["request_id"], finished=msg["finished"],
                           images=None if images is None else decode_array(images),
                           step_index=msg.get("step_index"), num_steps=msg.get("num_steps"),
                           phase=msg.get("phase"), metrics=msg.get("metrics") or {})


def exception_from_message(msg: dict[str, Any]) -> DiffStageError:
    """Client side: the error tree's exception for an ``error`` message."""
    if msg.get("error_type") == InvalidRequestError.error_type and "param" in msg:
        return InvalidRequestError(msg["param"], msg.get("value"), msg.get("reason") or msg["error"])
    return errors.from_wire(msg.get("error_type"), msg["error"])
