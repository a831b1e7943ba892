"""Cache acceleration through a real stage process (tiny DiT, step mode, ``--cache-mode block``, result
cache on): the response's ``cache`` member reports steps computed/skipped, an exact repeat returns the same
bytes from the result cache, ``/v1/requests`` shows a running request's counts, ``/metrics`` counts skipped
steps and hits, a bad ``cache`` value is a 400 naming the field; on this DiT stage, a class id out of range is a
400 naming the prompt at admission (over HTTP and through the OpenAI SDK, no retry)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from serve_probes import assert_refused_at_admission, metric_samples, wait_gone, wait_running
from stage_process import running_stage

UNI = ["--device", "cpu", "--executor", "uni"]


@pytest.fixture(scope="module")
def cache_stage(tiny_dit_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("cache-stage")
    with running_stage(["--model", tiny_dit_path, "--execution-mode", "step", "--max-num-seqs", "2",
                        "--cache-mode", "block", "--cache-threshold", "10", "--result-cache-bytes", "1048576", *UNI],
                       logs / "stage.log") as stage:
        yield stage


async def test_steps_skipped_are_reported_and_an_exact_repeat_is_served_from_the_result_cache(cache_stage):
    body = {"prompt": "7", "seed": 5, "num_inference_steps": 8}
    async with httpx.AsyncClient(base_url=cache_stage.http_url, timeout=120) as http:
        first = (await http.post("/v1/images/generations", json=body)).json()
        repeat = (await http.post("/v1/images/generations", json=body)).json()
        off = (await http.post("/v1/images/generations", json={**body, "cache": "off"})).json()
        metrics = metric_samples((await http.get("/metrics")).text)
    assert first["cache"] == {"steps_computed": 2, "steps_skipped": 6}          # warmup 1 + final 1 forced
    assert repeat["cache"] == {"result_cache_hit": True}
    assert repeat["data"][0]["b64_json"] == first["data"][0]["b64_json"]
    assert "cache" not in off and off["data"][0]["b64_json"] != first["data"][0]["b64_json"]
    assert metrics[("diffstage_cache_steps_total", (("outcome", "skipped"),))] >= 6
    assert metrics[("diffstage_result_cache_hits_total", ())] == 1


async def test_a_running_request_shows_its_counts_and_a_bad_cache_value_is_a_400(cache_stage):
    async with httpx.AsyncClient(base_url=cache_stage.http_url, timeout=120) as http:
        bad = await http.post("/v1/images/generations", json={"prompt": "7", "cache": {"threshold": -1}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache"
        body = {"prompt": "7", "num_inference_steps": 400, "request_id": "long", "cache": {"threshold": 10}}
        task = asyncio.create_task(http.post("/v1/images/generations", json=body))
        state = await wait_running(http, "long", min_step=3)
        assert state["steps_computed"] == 1 and state["steps_skipped"] == state["step"] - 1
        await http.post("/v1/abort", json={"request_ids": ["long"]})
        assert (await task).status_code == 409
        await wait_gone(http, "long")


def test_a_class_id_out_of_range_is_a_400_naming_the_prompt_at_admission(cache_stage):
    assert_refused_at_admission(cache_stage.http_url, {"prompt": "1000", "num_inference_steps": 2}, "prompt", "'1000'")
