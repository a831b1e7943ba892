"""RequestStream: one request's outputs, in order, to sync and asyncio readers, from any thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

from stage_runtime.engine.stream import RequestStream
from stage_runtime.errors import EngineClosedError, EngineDeadError, RequestAbortedError, RequestFailedError
from stage_runtime.outputs import DiffusionOutput


def progress(step: int) -> DiffusionOutput:
    return DiffusionOutput("r", finished=False, step_index=step, num_steps=3)


def test_items_arrive_in_order_and_the_final_one_ends_the_iteration():
    stream = RequestStream("r")
    for step in (1, 2):
        stream.put(progress(step))
    stream.put(DiffusionOutput("r", step_index=3))
    assert [(o.finished, o.step_index) for o in stream] == [(False, 1), (False, 2), (True, 3)]
    assert stream.finished


def test_nothing_is_accepted_after_the_final_item():
    stream = RequestStream("r")
    stream.put(DiffusionOutput("r", error="boom", error_type="request_failed"))
    stream.put(DiffusionOutput("r"))                          # a second final item is ignored
    stream.put(progress(1))
    assert stream.get(timeout=0).error == "boom"
    with pytest.raises(TimeoutError, match="no output for request r within 0.01 s"):
        stream.get(timeout=0.01)


@pytest.mark.parametrize(("error_type", "error_class"), [
    ("request_aborted", RequestAbortedError), ("engine_closed", EngineClosedError),
    ("engine_dead", EngineDeadError), ("request_failed", RequestFailedError), (None, RequestFailedError),
])
def test_result_raises_the_error_of_the_final_item(error_type, error_class):
    stream = RequestStream("r")
    stream.put(progress(1))
    stream.put(DiffusionOutput("r", error="why", error_type=error_type))
    with pytest.raises(error_class, match="why"):
        stream.result(timeout=1)


def test_a_reader_blocked_in_get_is_woken_by_a_put_from_another_thread():
    stream = RequestStream("r")
    threading.Timer(0.05, stream.put, args=(DiffusionOutput("r", step_index=2),)).start()
    assert stream.result(timeout=10).step_index == 2


async def test_asyncio_readers_are_woken_from_another_thread():
    stream = RequestStream("r")

    def produce() -> None:
        stream.put(progress(1))
        stream.put(DiffusionOutput("r", step_index=2))

    threading.Thread(target=produce).start()
    items = [item async for item in stream]
    assert [(i.finished, i.step_index) for i in items] == [(False, 1), (True, 2)]


async def test_aresult_skips_progress_and_returns_the_final_output():
    stream = RequestStream("r")
    stream.put(progress(1))
    stream.put(DiffusionOutput("r", step_index=3))
    assert (await asyncio.wait_for(stream.aresult(), 5)).step_index == 3


def test_a_closed_stream_drops_what_comes_later_and_a_dead_loop_never_breaks_put():
    stream = RequestStream("r")
    stream.put(progress(1))
    stream.close()
    stream.put(DiffusionOutput("r"))
    with pytest.raises(TimeoutError):
        stream.get(timeout=0.01)

    other = RequestStream("s")
    loop = asyncio.new_event_loop()
    loop.run_until_complete(_register_then_give_up(other))
    loop.close()                                              # the consumer's loop is gone, its waiter left
    other.put(DiffusionOutput("s"))                           # must not raise
    assert other.get(timeout=0).finished


async def _register_then_give_up(stream: RequestStream) -> None:
    task = asyncio.ensure_future(stream.aget())
    await asyncio.sleep(0)                                    # aget() registers its waiter
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
