"""A stage in step mode over HTTP: SSE with decoded previews, continuous batching of two streams, the
served model name, the startup states (``starting`` before warmup: /health 200, /ready 503), and a
``shutdown`` message over ZMQ draining it to exit 0."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from engine_probes import phased
from serve_probes import decode_png, metric_samples, sse_events
from stage_process import StageProcess

from stage_runtime.client import StageClient


@pytest.fixture(scope="module")
def step_stage(tiny_sd_path, tmp_path_factory, stage_topology):
    logs = tmp_path_factory.mktemp("step-stage")
    stage = StageProcess(["--model", tiny_sd_path, "--served-name", "tiny-sd", "--execution-mode", "step",
                          "--max-num-seqs", "4", *stage_topology], logs / "stage.log")
    try:
        stage.start(wait_ready=False)
        stage.wait_listening()
        with httpx.Client(base_url=stage.http_url, timeout=10) as http:   # the engine is still loading
            stats = http.get("/v1/stats").json()
            ready, health = http.get("/ready"), http.get("/health")
            early = http.post("/v1/images/generations", json={"prompt": "x"})
        stage.startup_view = (stats, ready, health, early)
        stage.wait_ready()
        yield stage
        stage.track()
        asyncio.run(_shutdown_over_zmq(stage.zmq_url))          # the same drain as SIGTERM
        assert stage.wait(60) == 0, stage.log[-3000:]
        assert "stop requested (shutdown message over ZMQ)" in stage.log
        stage.assert_no_leaks()
    finally:
        stage.kill()


async def _shutdown_over_zmq(url: str) -> None:
    async with StageClient(url) as client:
        await client.shutdown()                 # regression: closing right after used to drop the message


def test_starting_state_before_warmup(step_stage):
    stats, ready, health, early = step_stage.startup_view
    assert stats["state"] == "starting" and stats["workers"] == [] and stats["capacity"] == 4
    assert ready.status_code == 503 and ready.json()["error"]["type"] == "stage_unavailable"
    assert health.status_code == 200 and health.json()["state"] == "starting"
    assert early.status_code == 503 and early.json()["error"]["type"] == "stage_unavailable"


async def test_stream_with_previews_and_two_streams_batched(step_stage):
    async def stream(rid: str, steps: int) -> list[tuple[str, dict]]:
        body = {"prompt": "a cat", "model": "tiny-sd", "num_inference_steps": steps, "seed": 2, "stream": True,
                "preview_every": 2, "request_id": rid, "size": "64x64", "stream_format": "diffstage"}
        async with http.stream("POST", "/v1/images/generations", json=body) as resp:
            assert resp.status_code == 200
            return sse_events((await resp.aread()).decode())

    async with httpx.AsyncClient(base_url=step_stage.http_url, timeout=60) as http:
        a, b = await asyncio.gather(stream("step-a", 6), stream("step-b", 4))
        batches = metric_samples((await http.get("/metrics")).text)
    single = batches[("diffstage_batch_size_bucket", (("le", "1.0"),))]
    assert batches[("diffstage_batch_size_count", ())] > single            # some ticks ran both requests
    for events, steps in ((a, 6), (b, 4)):
        progress = [(d["phase"], d["step"]) for kind, d in events if kind == "progress"]
        assert progress == phased(steps)
        previews = [d for kind, d in events if kind == "partial_image"]
        assert [d["step"] for d in previews] == list(range(2, steps, 2))
        assert all(decode_png(d["data"][0]["b64_json"]).shape == (64, 64, 3) for d in previews)
        assert [kind for kind, _ in events].count("completed") == 1 and events[-1][0] == "completed"
    final_a = decode_png(a[-1][1]["data"][0]["b64_json"])
    assert final_a.shape == (64, 64, 3)


def test_served_name_is_checked(step_stage):
    with httpx.Client(base_url=step_stage.http_url, timeout=60) as http:
        wrong = http.post("/v1/images/generations", json={"prompt": "x", "model": "sdxl", "num_inference_steps": 1})
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "model"
        right = http.post("/v1/images/generations", json={"prompt": "x", "model": "tiny-sd", "num_inference_steps": 1})
        assert right.status_code == 200
