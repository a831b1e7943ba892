"""The real stage process over HTTP: generation (JSON and SSE), validation, admission, abort,
disconnects, stats/requests/metrics — against the shared stage of ``conftest.py``."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from engine_probes import phased
from serve_probes import (LONG_STEPS, decode_png, metric_samples, request_states, sse_events, wait_gone,
                         wait_running, wait_until)


@pytest.fixture
async def http(stage):
    async with httpx.AsyncClient(base_url=stage.http_url, timeout=60) as client:
        yield client


async def test_generate_returns_n_pngs_of_the_requested_size(http):
    body = {"prompt": "a red fox", "n": 2, "size": "64x32", "seed": 7, "num_inference_steps": 3,
            "request_id": "fox-1", "model": None, "response_format": "b64_json"}
    resp = await http.post("/v1/images/generations", json=body)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert data["id"] == "fox-1" and isinstance(data["created"], int)
    images = [decode_png(d["b64_json"]) for d in data["data"]]
    assert [im.shape for im in images] == [(32, 64, 3), (32, 64, 3)]           # "WxH": width 64, height 32
    assert (images[0] != images[1]).any()                                      # one generator per image
    again = await http.post("/v1/images/generations", json={**body, "request_id": "fox-2"})
    assert [decode_png(d["b64_json"]).tolist() for d in again.json()["data"]] == [im.tolist() for im in images]


async def test_stream_sends_progress_in_order_then_exactly_one_final(http):
    body = {"prompt": "a cat", "num_inference_steps": 5, "seed": 3, "stream": True, "request_id": "sse-1",
            "stream_format": "diffstage"}
    async with http.stream("POST", "/v1/images/generations", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        text = (await resp.aread()).decode()
    events = sse_events(text)
    kinds = [kind for kind, _ in events]
    assert kinds == ["progress"] * 6 + ["completed"]
    assert [(data["phase"], data["step"]) for _, data in events[:-1]] == phased(5)
    assert all(data["num_steps"] == 5 and data["id"] == "sse-1" for _, data in events[:-1])
    final = events[-1][1]
    assert final["type"] == "completed" and final["id"] == "sse-1"
    assert decode_png(final["data"][0]["b64_json"]).shape == (64, 64, 3)


BAD_FIELDS = [
    ({"prompt": "x", "size": "65x64"}, "size"),
    ({"prompt": "x", "size": "large"}, "size"),
    ({"prompt": "x", "size": "8192x64"}, "size"),
    ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps"),
    ({"prompt": "x", "num_inference_steps": "5"}, "num_inference_steps"),
    ({"prompt": "x", "n": 17}, "n"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "guidance_scale": -1}, "guidance_scale"),
    ({"prompt": "x", "guidance_scale": 1e9}, "guidance_scale"),
    ({"prompt": "x" * 2001}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"n": 1}, "prompt"),
    ({"prompt": "x", "negative_prompt": 3}, "negative_prompt"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "response_format": "url"}, "response_format"),
    ({"prompt": "x", "request_id": ""}, "request_id"),
    ({"prompt": "x", "colour": "red"}, "colour"),
    ({"prompt": "x", "preview_every": 2}, "preview_every"),                      # previews need stream
    ({"prompt": "x", "stream": True, "preview_every": 2}, "preview_every"),      # …and step mode
    ({"prompt": "x", "negative_prompt": "blurry", "guidance_scale": 1.0}, "negative_prompt"),   # unused without CFG
    ([{"prompt": "x"}], "body"),
]


@pytest.mark.parametrize("body,field", BAD_FIELDS, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_FIELDS)])
async def test_bad_input_is_400_naming_the_field(http, body, field):
    resp = await http.post("/v1/images/generations", json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field
    assert error["message"].startswith(f"{field}=")


async def test_body_that_is_not_json_is_400(http):
    resp = await http.post("/v1/images/generations", content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "body"


async def test_full_queue_is_429_with_retry_after(http):
    before = metric_samples((await http.get("/metrics")).text)
    long = {"prompt": "x", "num_inference_steps": LONG_STEPS}
    running = asyncio.create_task(http.post("/v1/images/generations", json={**long, "request_id": "q-run"}))
    await wait_running(http, "q-run")
    waiting = [asyncio.create_task(http.post("/v1/images/generations", json={**long, "request_id": f"q-wait-{i}"}))
               for i in range(2)]                                                      # max_waiting = 2
    await wait_until(lambda: _waiting_is(http, 2), what="two waiting")
    resp = await http.post("/v1/images/generations", json={**long, "request_id": "q-over"})
    assert resp.status_code == 429, resp.text
    assert resp.json()["error"]["type"] == "queue_full"
    assert 1 <= int(resp.headers["Retry-After"]) <= 60
    aborted = (await http.post("/v1/abort", json={"all": True})).json()
    assert sorted(aborted["aborted"]) == ["q-run", "q-wait-0", "q-wait-1"] and aborted["not_found"] == []
    for task in (running, *waiting):
        assert (await task).status_code == 409
    after = metric_samples((await http.get("/metrics")).text)
    key = ("diffstage_requests_total", (("outcome", "rejected"),))
    assert after[key] == before[key] + 1


async def _waiting_is(http, n: int) -> bool:
    return (await http.get("/v1/stats")).json()["waiting"] == n


async def test_abort_from_another_client_is_409_request_aborted(stage, http):
    victim = asyncio.create_task(http.post("/v1/images/generations",
                                           json={"prompt": "x", "num_inference_steps": LONG_STEPS,
                                                 "request_id": "victim"}))
    await wait_running(http, "victim")
    async with httpx.AsyncClient(base_url=stage.http_url, timeout=30) as other:
        resp = await other.post("/v1/abort", json={"request_ids": ["victim", "ghost"]})
        answer = resp.json()             # request mode: the victim is inside its pipeline call, between two steps
        message = answer.pop("message")
        assert answer == {"aborted": ["victim"], "not_found": ["ghost"], "in_step": ["victim"]}
        assert message.startswith("victim: inside a step; stops at the next step boundary")
        answer = await victim
        assert answer.status_code == 409
        assert answer.json()["error"]["type"] == "request_aborted"
        assert "victim" in answer.json()["error"]["message"]
        assert (await other.post("/v1/abort", json={"all": True})).json() == {"aborted": [], "not_found": [],
                                                                            "in_step": []}
        bad = await other.post("/v1/abort", json={"all": True, "request_ids": ["a"]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "all"
        bad = await other.post("/v1/abort", json={})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_ids"


async def test_client_disconnect_aborts_the_request(stage, http):
    aborted_before = (await http.get("/v1/stats")).json()["aborted_total"]
    async with httpx.AsyncClient(base_url=stage.http_url, timeout=60) as leaving:
        task = asyncio.create_task(leaving.post("/v1/images/generations",
                                                json={"prompt": "x", "num_inference_steps": LONG_STEPS,
                                                      "request_id": "leaver"}))
        await wait_running(http, "leaver")
        task.cancel()                                    # the client goes away mid-request
        await asyncio.gather(task, return_exceptions=True)
    await wait_gone(http, "leaver")

    body = {"prompt": "x", "num_inference_steps": LONG_STEPS, "request_id": "sse-leaver", "stream": True}
    async with httpx.AsyncClient(base_url=stage.http_url, timeout=60) as leaving:
        async with leaving.stream("POST", "/v1/images/generations", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    break                                # one progress event, then hang up
    await wait_gone(http, "sse-leaver")
    assert (await http.get("/v1/stats")).json()["aborted_total"] == aborted_before + 2


async def test_stats_requests_and_metrics_reflect_the_traffic(stage, http):
    stats0 = (await http.get("/v1/stats")).json()
    metrics0 = metric_samples((await http.get("/metrics")).text)
    assert set(stats0) == {"state", "waiting", "running", "capacity", "finished_total", "aborted_total",
                           "failed_total", "world_size", "topology", "workers", "startup", "cost", "weights"}
    assert stats0["state"] == "ready" and stats0["capacity"] == 1
    assert f"world_size={stats0['world_size']}" in stats0["topology"]
    assert [w["rank"] for w in stats0["workers"]] == list(range(stats0["world_size"]))
    assert all(w["alive"] and isinstance(w["pid"], int) for w in stats0["workers"])

    ok = await http.post("/v1/images/generations", json={"prompt": "x", "num_inference_steps": 2, "n": 2})
    assert ok.status_code == 200
    slow = asyncio.create_task(http.post("/v1/images/generations",
                                         json={"prompt": "x", "num_inference_steps": LONG_STEPS, "request_id": "obs"}))
    seen = await wait_running(http, "obs", min_step=2)
    assert seen["num_steps"] == LONG_STEPS and 2 <= seen["step"] < LONG_STEPS
    stats = (await http.get("/v1/stats")).json()
    assert stats["running"] == 1 and stats["waiting"] == 0
    live = metric_samples((await http.get("/metrics")).text)
    assert live[("diffstage_requests_running", ())] == 1
    await http.post("/v1/abort", json={"request_ids": ["obs"]})
    assert (await slow).status_code == 409
    await wait_gone(http, "obs")

    async def waves_counted() -> bool:          # an aborted request is answered before its wave returns
        samples = metric_samples((await http.get("/metrics")).text)
        return samples[("diffstage_batch_size_count", ())] >= metrics0[("diffstage_batch_size_count", ())] + 2

    await wait_until(waves_counted, timeout=10, what="both waves observed")
    stats1 = (await http.get("/v1/stats")).json()
    assert stats1["finished_total"] == stats0["finished_total"] + 1
    assert stats1["aborted_total"] == stats0["aborted_total"] + 1
    assert stats1["running"] == 0 and stats1["failed_total"] == stats0["failed_total"]
    metrics1 = metric_samples((await http.get("/metrics")).text)

    def delta(name, labels=()):
        return metrics1[(name, labels)] - metrics0.get((name, labels), 0.0)

    assert delta("diffstage_requests_total", (("outcome", "completed"),)) == 1
    assert delta("diffstage_requests_total", (("outcome", "aborted"),)) == 1
    assert delta("diffstage_images_generated_total") == 2
    assert delta("diffstage_request_e2e_seconds_count", (("outcome", "completed"),)) == 1
    assert delta("diffstage_request_e2e_seconds_count", (("outcome", "aborted"),)) == 1   # it ran too
    assert delta("diffstage_request_queue_seconds_count") == 2
    assert delta("diffstage_denoise_step_seconds_count") >= 2
    assert delta("diffstage_batch_size_count") >= 2
    assert metrics1[("diffstage_requests_waiting", ())] == 0
    assert metrics1[("diffstage_worker_alive", (("rank", "0"),))] == 1
    assert metrics1[("diffstage_stage_state", (("diffstage_stage_state", "ready"),))] == 1


async def test_health_ready_and_json_errors_for_unknown_routes(http):
    assert (await http.get("/health")).json() == {"status": "ok", "state": "ready"}
    ready = await http.get("/ready")
    assert ready.status_code == 200
    missing = await http.get("/v2/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found"
    wrong = await http.get("/v1/images/generations")
    assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "method_not_allowed"
    assert await request_states(http) == {}


@pytest.mark.parametrize("method, path", [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                                          ("POST", "/start_profile"), ("POST", "/stop_profile")])
async def test_the_admin_routes_are_404_on_a_stage_without_sleep_mode_or_profiler(http, method, path):
    resp = await http.request(method, path)
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found", resp.text
    assert ("--enable-sleep-mode" if "profile" not in path else "--profiler-dir") in resp.text
