"""Wire shapes (pure): outputs and errors survive msgpack, and come back as the error tree."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from stage_runtime.errors import (DeadlineExceededError, EngineDeadError, InvalidRequestError, QueueFullError, RequestAbortedError,
                                  RequestFailedError)
from stage_runtime.outputs import DiffusionOutput
from stage_runtime.serve.wire import (error_message, exception_from_message, output_from_message, output_message,
                                      pack, status_of, unpack)


def roundtrip(message: dict) -> dict:
    return unpack(pack(message))


def test_images_travel_raw_and_exact():
    images = np.random.default_rng(0).integers(0, 256, (2, 16, 24, 3), dtype=np.uint8)
    out = DiffusionOutput("r", images=images, step_index=4, num_steps=4, metrics={"e2e_ms": 3.5})
    back = output_from_message(roundtrip(output_message(out)))
    assert back.request_id == "r" and back.finished and back.ok
    assert back.images.dtype == np.uint8 and np.array_equal(back.images, images)
    assert back.metrics == {"e2e_ms": 3.5} and back.step_index == 4


def test_progress_items_are_results_and_failures_are_errors():
    progress = roundtrip(output_message(DiffusionOutput("r", finished=False, step_index=2, num_steps=5)))
    assert progress["type"] == "result" and progress["finished"] is False and progress["images"] is None
    failed = roundtrip(output_message(DiffusionOutput("r", error="Request r aborted.", error_type="request_aborted")))
    assert failed["type"] == "error" and failed["status_code"] == 409
    assert isinstance(exception_from_message(failed), RequestAbortedError)


@pytest.mark.parametrize("exc,status", [
    (QueueFullError("full"), 429), (EngineDeadError("rank 1 died"), 503), (RequestFailedError("boom"), 500),
    (InvalidRequestError("n", 0, "must be ≥ 1"), 400), (DeadlineExceededError("past timeout_s=1"), 504),
])
def test_errors_roundtrip_to_the_same_class_and_message(exc, status):
    msg = roundtrip(error_message(exc, request_id="r"))
    assert msg["status_code"] == status == status_of(msg["error_type"])
    back = exception_from_message(msg)
    assert type(back) is type(exc) and str(back) == str(exc)


def test_invalid_request_keeps_its_field():
    back = exception_from_message(roundtrip(error_message(InvalidRequestError("size", object(), "bad"), rpc_id=3)))
    assert isinstance(back, InvalidRequestError) and back.field == "size"


def test_rpc_results_encode_dataclasses_and_refuse_the_unencodable():
    @dataclass
    class Info:
        name: str
        heads: int

    assert roundtrip({"type": "rpc_result", "result": [Info("sd", 2)]})["result"] == [{"name": "sd", "heads": 2}]
    with pytest.raises(TypeError, match="cannot encode"):
        pack({"type": "rpc_result", "result": object()})


def test_unpack_refuses_what_is_not_a_typed_map():
    with pytest.raises(ValueError):
        unpack(pack([1, 2]))
    with pytest.raises(ValueError):
        unpack(pack({"kind": "x"}))
