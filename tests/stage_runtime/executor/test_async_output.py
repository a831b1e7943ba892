"""AsyncOutputTable: COMPUTE_DONE / OUTPUT_READY in either order, drops, failures, no leftovers."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

from stage_runtime.errors import EngineDeadError
from stage_runtime.executor.async_output import AsyncOutputTable


def test_engine_waits_first_then_output_arrives():
    table = AsyncOutputTable()
    future = table.wait("b/r1")
    assert not future.done() and len(table) == 1
    table.deliver({"b/r1": "img1"})
    assert future.result(0) == "img1" and len(table) == 0


def test_output_arrives_first_then_engine_waits():
    table = AsyncOutputTable()
    table.deliver({"b/r1": "img1", "b/r2": "img2"})
    assert len(table) == 2
    assert table.wait("b/r2").result(0) == "img2"
    assert table.wait("b/r1").result(0) == "img1"
    assert len(table) == 0


@pytest.mark.parametrize("order", ["drop-then-arrive", "arrive-then-drop", "wait-drop-arrive"])
def test_dropped_outputs_are_never_kept(order):
    table = AsyncOutputTable()
    if order == "drop-then-arrive":
        table.drop("x")
        assert len(table) == 1                       # remembered only until it arrives
        table.deliver({"x": "img"})
    elif order == "arrive-then-drop":
        table.deliver({"x": "img"})
        table.drop("x")
    else:
        future = table.wait("x")
        table.drop("x")
        assert future.cancelled()
        table.deliver({"x": "img"})
    assert len(table) == 0


def test_packing_failure_reaches_the_waiter_in_either_order():
    table = AsyncOutputTable()
    early = table.wait("a")
    table.deliver({}, failed={"a": "rank 0: OSError: no space", "b": "rank 0: OSError: no space"})
    with pytest.raises(RuntimeError, match="no space"):
        early.result(0)
    with pytest.raises(RuntimeError, match="no space"):
        table.wait("b").result(0)
    assert len(table) == 0


def test_fail_all_fails_waiters_forgets_cache_and_fails_later_waits():
    table = AsyncOutputTable()
    waiting = table.wait("a")
    table.deliver({"b": "img"})
    table.drop("c")
    table.fail_all(EngineDeadError("rank 1 (pid 9) killed by signal 9 (SIGKILL)"))
    with pytest.raises(EngineDeadError, match="rank 1"):
        waiting.result(0)
    with pytest.raises(EngineDeadError):
        table.wait("d").result(0)
    assert len(table) == 0


def test_a_waiter_cancelled_concurrently_never_breaks_delivery():
    table = AsyncOutputTable()
    futures = [table.wait(f"id{i}") for i in range(200)]
    for f in futures[::2]:
        f.cancel()
    barrier = threading.Barrier(2)

    def deliver():
        barrier.wait()
        table.deliver({f"id{i}": i for i in range(200)})

    thread = threading.Thread(target=deliver)
    thread.start()
    barrier.wait()
    for f in futures[1::2]:
        f.cancel()                                   # races with deliver(): either outcome is fine
    thread.join()
    for i, f in enumerate(futures):
        assert f.cancelled() or f.result(0) == i
    assert len(table) == 0


def test_exactly_one_result_under_concurrent_arrival_and_wait():
    for _ in range(200):
        table = AsyncOutputTable()
        box: list[concurrent.futures.Future] = []
        t = threading.Thread(target=lambda table=table, box=box: box.append(table.wait("id")))
        t.start()
        table.deliver({"id": "img"})
        t.join()
        assert box[0].result(1) == "img" and len(table) == 0
