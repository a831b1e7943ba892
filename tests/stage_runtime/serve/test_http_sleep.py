"""Sleep mode and the profiler over HTTP, in vLLM's shapes, on real stage processes.

Stage ``keyed``: the tiny SD on two CPU ranks (CFG parallel), request mode, an API key, ``--enable-sleep-mode`` and
``--profiler-dir``. Level 2 drops every rank's weights and the next image (a request wakes the stage) is bitwise the
one before; level 1 and ``wake_up``; ``abort=true`` answers the running request as an abort; a drain that times out
leaves the stage awake (409); a profile over three requests is one Chrome trace per rank with the engine's phases;
bad input is 400 naming ``level``, no key 401. Stage ``idle``: one rank, ``--sleep-after-idle-s 1``, no profiler: it
sleeps by itself and the official OpenAI SDK's request wakes it; the profiler's routes are 404 there.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import openai
import pytest
from serve_probes import LONG_STEPS, decode_png, metric_samples, wait_running
from support.waiting import wait_until
from stage_process import running_stage

KEY = "sleep-test-key"
ADMIN = [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"), ("POST", "/start_profile"),
         ("POST", "/stop_profile")]


@pytest.fixture(scope="module")
def keyed(tiny_sd_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("sleep")
    (root / "keys").write_text(KEY + "\n")
    args = ["--model", tiny_sd_path, "--device", "cpu", "--executor", "mp", "--cfg-parallel-size", "2",
            "--max-num-seqs", "2", "--api-key-file", str(root / "keys"), "--enable-sleep-mode",
            "--profiler-dir", str(root / "profiles")]
    with running_stage(args, root / "keyed.log") as stage:
        yield stage


@pytest.fixture(scope="module")
def idle(tiny_sd_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("idle")
    args = ["--model", tiny_sd_path, "--device", "cpu", "--executor", "uni", "--enable-sleep-mode",
            "--sleep-after-idle-s", "1", "--sleep-level", "2"]
    with running_stage(args, root / "idle.log") as stage:
        yield stage


def client(stage) -> httpx.Client:
    return httpx.Client(base_url=stage.http_url, timeout=120, headers={"Authorization": f"Bearer {KEY}"})


def image(http: httpx.Client, seed: int = 4, steps: int = 3) -> np.ndarray:
    resp = http.post("/v1/images/generations", json={"prompt": "a cat", "seed": seed, "size": "64x64",
                                                     "num_inference_steps": steps})
    assert resp.status_code == 200, resp.text
    return decode_png(resp.json()["data"][0]["b64_json"])


def test_level_2_drops_every_ranks_weights_and_a_request_wakes_it_to_the_same_image(keyed):
    with client(keyed) as http:
        before = image(http)
        slept = http.post("/sleep", params={"level": 2})
        assert slept.status_code == 200, slept.text
        assert [r["rank"] for r in slept.json()["ranks"]] == [0, 1] and slept.json()["level"] == 2
        assert http.get("/is_sleeping").json() == {"is_sleeping": True, "level": 2}
        metrics = metric_samples(http.get("/metrics").text)
        assert (metrics[("diffstage_sleeping", ())], metrics[("diffstage_sleep_level", ())]) == (1, 2)
        wakes = metrics[("diffstage_wake_seconds_count", ())]
        assert np.array_equal(image(http), before)                  # the request woke the stage
        assert http.get("/is_sleeping").json() == {"is_sleeping": False, "level": None}
        view = http.get("/v1/stats").json()["sleep"]
        metrics = metric_samples(http.get("/metrics").text)
        assert metrics[("diffstage_wake_seconds_count", ())] == wakes + 1 and metrics[("diffstage_sleeping", ())] == 0
        assert view["last_wake_s"] > 0 and view["wakes_total"] >= 1


def test_level_1_and_wake_up_and_wake_up_while_awake_changes_nothing(keyed):
    with client(keyed) as http:
        assert http.post("/sleep", params={"level": "1"}).json()["level"] == 1
        woke = http.post("/wake_up")
        assert woke.status_code == 200 and woke.json()["is_sleeping"] is False
        wakes = http.get("/v1/stats").json()["sleep"]["wakes_total"]
        again = http.post("/wake_up")
        assert again.status_code == 200 and again.json()["already"] is True
        assert http.get("/v1/stats").json()["sleep"]["wakes_total"] == wakes


async def _running_then(stage, params: dict) -> tuple[httpx.Response, httpx.Response]:
    """A long request, and once it runs, POST /sleep with ``params``: (the sleep's answer, the request's)."""
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=stage.http_url, timeout=120, headers=headers) as http:
        long = asyncio.create_task(http.post("/v1/images/generations", json={
            "prompt": "a dog", "size": "64x64", "num_inference_steps": LONG_STEPS, "request_id": f"long-{len(params)}"}))
        await wait_running(http, f"long-{len(params)}")
        slept = await http.post("/sleep", params=params)
        if slept.status_code != 200:
            await http.post("/v1/abort", json={"request_ids": [f"long-{len(params)}"]})
        return slept, await long


def test_a_drain_that_times_out_leaves_the_stage_awake_and_abort_true_aborts_the_running_request(keyed):
    slept, answer = asyncio.run(_running_then(keyed, {"level": "1", "drain_timeout_s": "0.5"}))
    assert slept.status_code == 409 and slept.json()["error"]["type"] == "stage_busy", slept.text
    assert answer.status_code == 409 and answer.json()["error"]["type"] == "request_aborted"
    with client(keyed) as http:
        assert http.get("/is_sleeping").json()["is_sleeping"] is False
    slept, answer = asyncio.run(_running_then(keyed, {"level": "1", "abort": "true", "drain_timeout_s": "60"}))
    assert slept.status_code == 200 and slept.json()["level"] == 1, slept.text
    assert answer.status_code == 409 and answer.json()["error"]["type"] == "request_aborted", answer.text
    with client(keyed) as http:
        assert http.post("/wake_up").json()["is_sleeping"] is False


@pytest.mark.parametrize("params, field", [({"level": "3"}, "level"), ({"level": "two"}, "level"),
                                           ({"abort": "maybe"}, "abort"), ({"drain_timeout_s": "-1"},
                                                                           "drain_timeout_s")])
def test_bad_input_is_400_naming_the_field(keyed, params, field):
    with client(keyed) as http:
        resp = http.post("/sleep", params=params)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == field, resp.text
        assert http.get("/is_sleeping").json()["is_sleeping"] is False


@pytest.mark.parametrize("method, path", ADMIN)
def test_the_admin_routes_need_the_key(keyed, method, path):
    resp = httpx.request(method, f"{keyed.http_url}{path}", timeout=30)
    assert resp.status_code == 401 and resp.headers["WWW-Authenticate"] == "Bearer", resp.text


def test_a_profile_of_three_requests_is_one_trace_per_rank_with_the_engines_phases(keyed):
    with client(keyed) as http:
        started = http.post("/start_profile")
        assert started.status_code == 200 and started.json()["ranks"] == 2, started.text
        second = http.post("/start_profile")
        assert second.status_code == 409 and second.json()["error"]["type"] == "stage_busy"
        for seed in range(3):
            image(http, seed=seed, steps=2)
        stopped = http.post("/stop_profile")
        assert stopped.status_code == 200, stopped.text
        assert http.post("/stop_profile").status_code == 409                 # nothing records now
    files = stopped.json()["files"]
    assert sorted(f["rank"] for f in files) == [0, 1]
    for entry in files:
        with open(entry["path"]) as f:
            names = {e.get("name", "") for e in json.load(f)["traceEvents"]}
        for phase in ("execute step=", "encode [", "denoise step 1/2 [", "decode ["):
            assert any(n.startswith(phase) for n in names), (entry["rank"], phase)


def test_an_idle_stage_sleeps_by_itself_and_the_openai_sdk_wakes_it(idle):
    wait_until(lambda: httpx.get(f"{idle.http_url}/is_sleeping", timeout=10).json()["is_sleeping"], timeout=60,
               what="the idle stage asleep")
    assert httpx.get(f"{idle.http_url}/is_sleeping", timeout=10).json()["level"] == 2
    assert httpx.get(f"{idle.http_url}/health", timeout=10).status_code == 200           # asleep, still alive
    with openai.OpenAI(base_url=f"{idle.http_url}/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        result = sdk.images.generate(prompt="a cat", size="64x64", extra_body={"num_inference_steps": 2})
    assert decode_png(result.data[0].b64_json).std() > 1
    stats = httpx.get(f"{idle.http_url}/v1/stats", timeout=10).json()["sleep"]
    assert stats["sleeps_total"] >= 1 and stats["wakes_total"] >= 1


@pytest.mark.parametrize("path", ["/start_profile", "/stop_profile"])
def test_the_profiler_routes_are_404_on_a_stage_without_it(idle, path):
    resp = httpx.post(f"{idle.http_url}{path}", timeout=30)
    assert resp.status_code == 404 and "--profiler-dir" in resp.text, resp.text
