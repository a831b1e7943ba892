"""``timeout_s`` and ``priority`` over the real stage's HTTP and ZMQ frontends: 504 ``deadline_exceeded``
for a request whose deadline passed in the queue (step 0, never ran) or while running (the next step)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from serve_probes import LONG_STEPS, metric_samples, wait_gone, wait_running

from stage_runtime.client import StageClient
from stage_runtime.errors import DeadlineExceededError

DEADLINE = ("diffstage_requests_total", (("outcome", "deadline_exceeded"),))


@pytest.fixture
async def http(stage):
    async with httpx.AsyncClient(base_url=stage.http_url, timeout=60) as client:
        yield client


@pytest.mark.parametrize("body, field", [
    ({"prompt": "x", "priority": "high"}, "priority"),
    ({"prompt": "x", "priority": 10_000}, "priority"),
    ({"prompt": "x", "timeout_s": 0}, "timeout_s"),
    ({"prompt": "x", "timeout_s": "soon"}, "timeout_s"),
])
async def test_bad_priority_or_timeout_is_400_naming_the_field(http, body, field):
    resp = await http.post("/v1/images/generations", json=body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == field


async def test_a_queued_request_past_its_deadline_is_504_unrun_and_a_running_one_is_504_at_the_next_step(http):
    before = metric_samples((await http.get("/metrics")).text)
    holder = asyncio.create_task(http.post("/v1/images/generations", json={
        "prompt": "x", "num_inference_steps": LONG_STEPS, "request_id": "dl-hold", "priority": 1}))
    await wait_running(http, "dl-hold")                       # capacity 1: the next one queues
    queued = await http.post("/v1/images/generations", json={
        "prompt": "x", "num_inference_steps": 2, "request_id": "dl-queued", "timeout_s": 0.3})
    assert queued.status_code == 504, queued.text
    error = queued.json()["error"]
    assert error["type"] == "deadline_exceeded" and "at step 0 of 2" in error["message"]
    await http.post("/v1/abort", json={"request_ids": ["dl-hold"]})
    assert (await holder).status_code == 409
    await wait_gone(http, "dl-hold")
    running = await http.post("/v1/images/generations", json={
        "prompt": "x", "num_inference_steps": LONG_STEPS, "request_id": "dl-run", "timeout_s": 0.5})
    assert running.status_code == 504 and running.json()["error"]["type"] == "deadline_exceeded"
    assert f"of {LONG_STEPS}" in running.json()["error"]["message"]
    after = metric_samples((await http.get("/metrics")).text)
    assert after[DEADLINE] == before[DEADLINE] + 2
    assert after[("diffstage_request_deadline_queue_seconds_count", ())] == \
        before[("diffstage_request_deadline_queue_seconds_count", ())] + 1


async def test_zmq_add_request_takes_timeout_s_and_raises_deadline_exceeded(stage):
    async with StageClient(stage.zmq_url) as client:
        with pytest.raises(DeadlineExceededError, match="deadline"):
            await client.generate("x", request_id="dl-zmq", num_inference_steps=LONG_STEPS, timeout_s=0.4,
                                  priority=2, timeout=60)
