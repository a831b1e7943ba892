"""The real stage process over ZMQ with StageClient: generation, streaming, several clients at once,
abort from another client, errors from the error tree, control RPCs, health, and a vanishing peer."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
import zmq
import zmq.asyncio
from engine_probes import phased, progress_of
from serve_probes import LONG_STEPS, decode_png, request_states, wait_gone, wait_running, wait_until

from stage_runtime.client import StageClient
from stage_runtime.errors import InvalidRequestError, QueueFullError, RequestAbortedError, RpcError
from stage_runtime.serve.wire import pack, unpack


@pytest.fixture
async def http(stage):
    async with httpx.AsyncClient(base_url=stage.http_url, timeout=60) as client:
        yield client


@pytest.fixture
async def client(stage):
    async with StageClient(stage.zmq_url) as c:
        yield c


async def test_generate_raw_images_equal_the_http_pngs(client, http):
    out = await client.generate("a red fox", request_id="z-fox", num_inference_steps=3, seed=7, num_outputs=2,
                                width=64, height=32, timeout=60)
    assert out.ok and out.request_id == "z-fox"
    assert out.images.shape == (2, 32, 64, 3) and out.images.dtype == np.uint8
    assert {"queue_ms", "exec_ms", "e2e_ms"} <= set(out.metrics)
    resp = await http.post("/v1/images/generations", json={"prompt": "a red fox", "num_inference_steps": 3, "seed": 7,
                                                           "n": 2, "size": "64x32"})
    pngs = np.stack([decode_png(d["b64_json"]) for d in resp.json()["data"]])
    assert np.array_equal(pngs, out.images)                       # same seed, same pixels, either frontend


async def test_stream_yields_progress_in_order_then_one_final(client):
    stream = await client.add_request("a cat", request_id="z-stream", num_inference_steps=5, seed=1, stream=True)
    items = [item async for item in stream]
    assert progress_of(items) == phased(5) and items[-1].finished
    assert items[-1].ok and items[-1].images.shape == (1, 64, 64, 3)
    assert all(i.request_id == "z-stream" and i.num_steps == 5 for i in items)


async def test_several_clients_at_once_get_their_own_results(stage):
    async with StageClient(stage.zmq_url) as a, StageClient(stage.zmq_url) as b:
        # Two in flight at once (one running + one waiting fits max_waiting=2 whatever the timing).
        outs = await asyncio.gather(a.generate("a cat", request_id="a-1", num_inference_steps=2, seed=1, timeout=60),
                                    b.generate("a cat", request_id="b-1", num_inference_steps=2, seed=2, timeout=60))
        outs.append(await a.generate("a cat", request_id="a-2", num_inference_steps=2, seed=1, timeout=60))
    assert [o.request_id for o in outs] == ["a-1", "b-1", "a-2"]
    assert np.array_equal(outs[0].images, outs[2].images)        # same seed
    assert not np.array_equal(outs[0].images, outs[1].images)    # routed by id, not by arrival


async def test_abort_from_another_client(stage, client, http):
    stream = await client.add_request("x", request_id="z-victim", num_inference_steps=LONG_STEPS)
    await wait_running(http, "z-victim")
    async with StageClient(stage.zmq_url) as other:
        answer = await other.abort(["z-victim", "z-ghost"])
        assert {k: answer[k] for k in ("aborted", "not_found", "in_step")} == {
            "aborted": ["z-victim"], "not_found": ["z-ghost"], "in_step": ["z-victim"]}
        assert "stops at the next step boundary" in answer["message"]
    with pytest.raises(RequestAbortedError, match="z-victim"):
        await stream.result(timeout=30)


async def test_errors_come_back_as_the_error_tree(client, http):
    with pytest.raises(InvalidRequestError) as info:
        await client.generate("x", num_inference_steps=0, timeout=30)
    assert info.value.field == "num_inference_steps"
    with pytest.raises(InvalidRequestError) as info:
        await client.generate("x", colour="red", timeout=30)
    assert info.value.field == "colour"

    running = await client.add_request("x", request_id="zq-run", num_inference_steps=LONG_STEPS)
    await wait_running(http, "zq-run")
    waiting = [await client.add_request("x", request_id=f"zq-wait-{i}", num_inference_steps=LONG_STEPS)
               for i in range(2)]
    with pytest.raises(QueueFullError, match="max_waiting=2"):
        await client.generate("x", request_id="zq-over", num_inference_steps=2, timeout=30)
    assert sorted((await client.abort(all=True))["aborted"]) == ["zq-run", "zq-wait-0", "zq-wait-1"]
    for stream in (running, *waiting):
        with pytest.raises(RequestAbortedError):
            await stream.result(timeout=30)


async def test_collective_rpc_and_health(client, http):
    world = (await http.get("/v1/stats")).json()["world_size"]
    assert await client.collective_rpc("ping", timeout=30) == list(range(world))
    assert await client.collective_rpc("ping", timeout=30, unique_reply_rank=0) == 0
    info = await client.collective_rpc("model_info", timeout=30, unique_reply_rank=0)
    assert info["pipeline_class"] == "StableDiffusionPipeline"
    assert await client.health() == {"healthy": True, "state": "ready", "reason": None}


@pytest.mark.parametrize("method", ["shutdown", "load_model", "__init__", "init_device", "execute_model",
                                    "no_such_method", "__class__"])
async def test_only_declared_control_rpcs_are_served_and_the_stage_keeps_serving(client, method):
    with pytest.raises(RpcError, match=rf"method='{method}' is not a control RPC; the workers offer: ping, "):
        await client.collective_rpc(method, timeout=30)
    assert await client.health() == {"healthy": True, "state": "ready", "reason": None}
    out = await client.generate("a cat", request_id=f"after-{method}", num_inference_steps=2, seed=1, timeout=60)
    assert out.images.shape == (1, 64, 64, 3)


async def test_garbage_and_unknown_messages_get_an_error_reply(stage):
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(stage.zmq_url)
    try:
        await sock.send(b"\xc1 not msgpack")
        reply = unpack(await asyncio.wait_for(sock.recv(), 10))
        assert reply["type"] == "error" and reply["error_type"] == "invalid_request_error"
        await sock.send(pack({"type": "launch", "rpc_id": "r1"}))
        reply = unpack(await asyncio.wait_for(sock.recv(), 10))
        assert reply["type"] == "error" and reply["rpc_id"] == "r1" and reply["param"] == "type"
    finally:
        sock.close()
        ctx.term()


async def test_a_vanished_client_has_its_request_aborted(stage, http):
    aborted_before = (await http.get("/v1/stats")).json()["aborted_total"]
    leaving = StageClient(stage.zmq_url)
    leaving.connect()
    stream = await leaving.add_request("x", request_id="z-leaver", num_inference_steps=LONG_STEPS, stream=True)
    await stream.get(timeout=30)                  # the first progress item: it runs
    await leaving.close()                         # the peer disappears; the next progress send is unroutable
    await wait_gone(http, "z-leaver")
    await wait_until(lambda: _aborted_is(http, aborted_before + 1), what="aborted counted")
    assert await request_states(http) == {}


async def _aborted_is(http, n: int) -> bool:
    return (await http.get("/v1/stats")).json()["aborted_total"] == n
