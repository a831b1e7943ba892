"""AsyncOutputTable: COMPUTE_DONE / OUTPUT_READY in either order, drops, failures, no leftovers.

The engine claims an async output id; the table calls its hook exactly once per claimed id, with the
images or the reason they are lost — whichever of the claim and the arrival comes first.
"""

from __future__ import annotations

import threading

import pytest

from stage_runtime.errors import EngineDeadError
from stage_runtime.executor.async_output import AsyncOutputTable


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self._lock = threading.Lock()

    def __call__(self, async_id, images, error) -> None:
        with self._lock:
            self.calls.append((async_id, images, error))


@pytest.fixture
def hook() -> Recorder:
    return Recorder()


def test_engine_claims_first_then_output_arrives(hook):
    table = AsyncOutputTable(hook)
    table.claim("b/r1")
    assert hook.calls == [] and len(table) == 1
    table.deliver({"b/r1": "img1"})
    assert hook.calls == [("b/r1", "img1", None)] and len(table) == 0


def test_output_arrives_first_then_the_claim_delivers_at_once(hook):
    table = AsyncOutputTable(hook)
    table.deliver({"b/r1": "img1", "b/r2": "img2"})
    assert hook.calls == [] and len(table) == 2
    table.claim("b/r2")
    table.claim("b/r1")
    assert hook.calls == [("b/r2", "img2", None), ("b/r1", "img1", None)] and len(table) == 0


@pytest.mark.parametrize("order", ["drop-then-arrive", "arrive-then-drop", "claim-drop-arrive"])
def test_dropped_outputs_are_never_kept_nor_delivered(hook, order):
    table = AsyncOutputTable(hook)
    if order == "drop-then-arrive":
        table.drop("x")
        assert len(table) == 1                       # remembered only until it arrives
        table.deliver({"x": "img"})
    elif order == "arrive-then-drop":
        table.deliver({"x": "img"})
        table.drop("x")
    else:
        table.claim("x")
        table.drop("x")
        table.deliver({"x": "img"})
    assert len(table) == 0 and hook.calls == []


def test_packing_failure_reaches_the_claimant_in_either_order(hook):
    table = AsyncOutputTable(hook)
    table.claim("a")
    table.deliver({}, failed={"a": "rank 0: OSError: no space", "b": "rank 0: OSError: no space"})
    table.claim("b")
    assert hook.calls == [("a", None, "rank 0: OSError: no space"), ("b", None, "rank 0: OSError: no space")]
    assert len(table) == 0


def test_fail_all_tells_claimants_forgets_arrivals_and_fails_later_claims(hook):
    table = AsyncOutputTable(hook)
    table.claim("a")
    table.deliver({"b": "img"})
    table.drop("c")
    table.fail_all(EngineDeadError("rank 1 (pid 9) killed by signal 9 (SIGKILL)"))
    assert hook.calls == [("a", None, "rank 1 (pid 9) killed by signal 9 (SIGKILL)")]
    table.claim("d")
    assert hook.calls[-1] == ("d", None, "rank 1 (pid 9) killed by signal 9 (SIGKILL)")
    assert len(table) == 0


def test_drops_racing_delivery_never_deliver_a_dropped_id_twice_or_leak(hook):
    table = AsyncOutputTable(hook)
    for i in range(200):
        table.claim(f"id{i}")
    barrier = threading.Barrier(2)

    def deliver():
        barrier.wait()
        table.deliver({f"id{i}": i for i in range(200)})

    thread = threading.Thread(target=deliver)
    thread.start()
    barrier.wait()
    for i in range(0, 200, 2):
        table.drop(f"id{i}")                         # races with deliver(): delivered or dropped, once
    thread.join()
    delivered = [c[0] for c in hook.calls]
    assert len(delivered) == len(set(delivered))
    assert {f"id{i}" for i in range(1, 200, 2)} <= set(delivered)
    assert len(table) == 0


def test_exactly_one_delivery_under_concurrent_arrival_and_claim():
    for _ in range(200):
        hook = Recorder()
        table = AsyncOutputTable(hook)
        t = threading.Thread(target=table.claim, args=("id",))
        t.start()
        table.deliver({"id": "img"})
        t.join()
        assert hook.calls == [("id", "img", None)] and len(table) == 0
