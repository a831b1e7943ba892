"""ResultPump: the one thread that reads every rank's result channel, over real ZMQ sockets.

Replies resolve the pending RPC once every expected rank answered; replies nobody waits for are dropped;
OUTPUT_READY reaches the async-output table, Progress and Fatal their hooks; shared-memory handles are
unpacked (and their segments unlinked) on arrival, wanted or not; fail_all fails what is pending and later.
"""

from __future__ import annotations

import pickle
import secrets
import tempfile

import numpy as np
import pytest
import zmq
from support.waiting import wait_until

from stage_runtime.errors import EngineDeadError
from stage_runtime.executor import shm
from stage_runtime.executor.async_output import AsyncOutputTable
from stage_runtime.executor.messages import ComputeDone, Fatal, OutputReady, Progress, RpcReply
from stage_runtime.executor.result_pump import ResultPump
from stage_runtime.outputs import BatchRunnerOutput, RunnerOutput


class Channels:
    """Two ranks' PUSH → PULL result channels on ipc sockets, and a running pump over them."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="ds-pump-test-")
        self.ctx = zmq.Context()
        self.pulls = [self.ctx.socket(zmq.PULL) for _ in range(2)]
        self.pushes = [self.ctx.socket(zmq.PUSH) for _ in range(2)]
        for rank, (pull, push) in enumerate(zip(self.pulls, self.pushes, strict=True)):
            pull.bind(f"ipc://{self.dir}/r{rank}")
            push.connect(f"ipc://{self.dir}/r{rank}")
        self.delivered: list[tuple] = []
        self.progress: list[Progress] = []
        self.fatal: list[Fatal] = []
        self.outputs = AsyncOutputTable(lambda *item: self.delivered.append(item))
        self.pump = ResultPump(self.pulls, self.outputs, self.progress.append, self.fatal.append)
        self.pump.start()

    def send(self, rank: int, msg) -> None:
        self.pushes[rank].send(pickle.dumps(msg))

    def close(self) -> None:
        self.pump.stop()
        for sock in self.pulls + self.pushes:
            sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def ch():
    channels = Channels()
    yield channels
    channels.close()


def test_an_rpc_resolves_once_every_expected_rank_answered(ch):
    future = ch.pump.expect(7, [0, 1])
    ch.send(0, RpcReply(7, 0, result="r0"))
    wait_until(lambda: ch.pump.num_pending() == 1 and not future.done(), what="rank 0's reply routed")
    ch.send(1, RpcReply(7, 1, result="r1"))
    replies = future.result(timeout=10)
    assert {rank: r.result for rank, r in replies.items()} == {0: "r0", 1: "r1"}
    assert ch.pump.num_pending() == 0


def test_replies_nobody_waits_for_are_dropped(ch):
    future = ch.pump.expect(8, [0])
    ch.send(1, RpcReply(8, 1, result="not expected from rank 1"))
    ch.send(0, RpcReply(99, 0, result="unknown rpc"))
    ch.send(0, RpcReply(8, 0, result="ok"))
    assert future.result(timeout=10)[0].result == "ok" and ch.pump.num_pending() == 0


def test_compute_done_then_output_ready_reach_the_table(ch):
    future = ch.pump.expect(3, [0])
    ch.send(0, ComputeDone(3, 0, result=BatchRunnerOutput.of(RunnerOutput("a", async_output_id="b/a"))))
    assert future.result(timeout=10)[0].result.get("a").async_output_id == "b/a"
    ch.outputs.claim("b/a")
    ch.send(0, OutputReady(0, {"b/a": np.zeros((1, 2, 2, 3), np.uint8)}))
    wait_until(lambda: ch.delivered, what="the late images delivered")
    (async_id, images, error), = ch.delivered
    assert async_id == "b/a" and images.shape == (1, 2, 2, 3) and error is None


def test_progress_and_fatal_go_to_their_hooks_in_order(ch):
    for step in range(3):
        ch.send(0, Progress(5, 0, ("a",), step, 3))
    ch.send(1, Fatal(1, "all_gather timed out"))
    wait_until(lambda: len(ch.progress) == 3 and ch.fatal, what="3 progress messages and the fatal one")
    assert [p.step_index for p in ch.progress] == [0, 1, 2] and ch.fatal[0].reason == "all_gather timed out"


def test_shared_memory_is_unlinked_on_arrival_even_when_nobody_wants_the_reply(ch):
    prefix = f"ds-pumptest-{secrets.token_hex(3)}-"
    writer = shm.ShmWriter(prefix, 0, threshold=16)
    big = np.arange(4096, dtype=np.uint8).reshape(1, 32, 32, 4)[..., :3].copy()
    ch.send(0, RpcReply(42, 0, result=writer.pack({"images": big})))          # rpc 42: nobody expects it
    future = ch.pump.expect(43, [0])
    ch.send(0, RpcReply(43, 0, result=writer.pack({"images": big})))
    assert np.array_equal(future.result(timeout=10)[0].result["images"], big)
    wait_until(lambda: list(shm.SHM_DIR.glob(f"{prefix}*")) == [], timeout=10, what="no segment left")


def test_fail_all_fails_pending_and_later_rpcs_and_the_claimed_outputs(ch):
    pending = ch.pump.expect(1, [0, 1])
    ch.outputs.claim("x/y")
    ch.pump.fail_all(EngineDeadError("rank 1 (pid 7) killed by signal 9 (SIGKILL)"))
    with pytest.raises(EngineDeadError, match="rank 1"):
        pending.result(timeout=1)
    with pytest.raises(EngineDeadError):
        ch.pump.expect(2, [0]).result(timeout=1)
    assert ch.delivered == [("x/y", None, "rank 1 (pid 7) killed by signal 9 (SIGKILL)")]
    assert ch.pump.num_pending() == 0 and len(ch.outputs) == 0
