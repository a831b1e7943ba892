"""A compiled stage over HTTP (``serve --model tiny-digits --device cpu --max-num-seqs 8 --compile regional``): ready
only once its warm-up has compiled, a mixed step-batched load (1 to 4 images a request joining and leaving the
batch, CFG on and then off (guidance is in the step key: they never share a tick), block-cache skips, a preemption and
its resume, an abort mid-way) compiles no graph after warm-up, every image is within 2 (uint8)
of the same stage without compile, and ``/v1/stats`` and ``/metrics`` say so."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from serve_probes import decode_png, metric_samples, request_states, wait_running
from stage_process import running_stage

from support.compile_cache import shared_compile_cache
from support.waiting import async_wait_until

STAGE = ["--model", "tiny-digits", "--device", "cpu", "--max-num-seqs", "8", "--execution-mode", "step",
         "--scheduling-policy", "priority"]
LOW_STEPS = 150          # the 8 first requests run long enough for the preempting one to find them all running


@pytest.fixture(scope="module")
def compiled_stage(tmp_path_factory):
    logs = tmp_path_factory.mktemp("compiled-stage")
    args = [*STAGE, "--compile", "regional", "--compile-cache-dir", str(shared_compile_cache())]
    with running_stage(args, logs / "stage.log", ready_timeout=900) as stage:
        yield stage


@pytest.fixture(scope="module")
def eager_stage(tmp_path_factory):
    logs = tmp_path_factory.mktemp("eager-stage")
    with running_stage(STAGE, logs / "stage.log") as stage:
        yield stage


def _stats(stage) -> dict:
    return httpx.get(f"{stage.http_url}/v1/stats", timeout=30).json()


async def mixed_load(url: str) -> dict[str, dict]:
    """Every request of the load → {"images": [...], "cache": {...}} (or {"error": type} when it ended so)."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        async def generate(rid: str, **fields) -> dict:
            body = {"request_id": rid, "seed": sum(map(ord, rid)) % 1000, **fields}
            resp = await http.post("/v1/images/generations", json=body)
            body = resp.json()
            if resp.status_code != 200:
                return {"error": body["error"]["type"]}
            return {"images": [decode_png(d["b64_json"]) for d in body["data"]], "cache": body.get("cache")}

        low = {f"low-{i}": asyncio.create_task(generate(
            f"low-{i}", prompt=str(i), n=1 + i % 4, num_inference_steps=LOW_STEPS - 7 * i,
            cache={"threshold": 1.0} if i % 2 else None)) for i in range(8)}

        async def all_running() -> bool:
            states = await request_states(http)
            return sum(s["state"] == "running" for s in states.values()) == 8

        await async_wait_until(all_running, timeout=120, what="the 8 low-priority requests running")
        high = asyncio.create_task(generate("high", prompt="seven", n=2, priority=5, num_inference_steps=12))
        doomed = asyncio.create_task(generate("doomed", prompt="1", priority=9, num_inference_steps=900))
        await wait_running(http, "doomed", min_step=2)
        assert (await http.post("/v1/abort", json={"request_ids": ["doomed"]})).status_code == 200
        unguided = {f"plain-{n}": asyncio.create_task(generate(f"plain-{n}", prompt="4", n=n, guidance_scale=1.0,
                                                               num_inference_steps=9)) for n in (1, 3)}
        return {rid: await task for rid, task in {**low, "high": high, "doomed": doomed, **unguided}.items()}


def test_ready_means_compiled(compiled_stage, eager_stage):
    view = _stats(compiled_stage)["compile"]
    assert view["mode"] == view["mode_effective"] == "regional" and view["reason"] is None, view
    assert view["warm"] and view["graphs"] >= 2 and view["recompiles"] == 0, view
    assert view["cache"] in ("hit", "miss", "partial") and view["cold_compile_s"] >= 0, view
    assert view["ranks"][0]["regions"] == [{"name": "BasicTransformerBlock", "modules": 5}], view
    assert "compile" not in _stats(eager_stage)


def test_a_mixed_load_compiles_nothing_after_warm_up_and_draws_what_the_eager_stage_draws(compiled_stage,
                                                                                             eager_stage):
    graphs = _stats(compiled_stage)["compile"]["graphs"]
    compiled = asyncio.run(mixed_load(compiled_stage.http_url))
    eager = asyncio.run(mixed_load(eager_stage.http_url))

    view = _stats(compiled_stage)["compile"]
    assert (view["graphs"], view["recompiles"], view["eager_calls"]) == (graphs, 0, {}), view
    assert compiled["doomed"] == eager["doomed"] == {"error": "request_aborted"}
    skipped = 0
    for rid in sorted(set(compiled) - {"doomed"}):
        assert len(compiled[rid]["images"]) == len(eager[rid]["images"]), rid
        for mine, theirs in zip(compiled[rid]["images"], eager[rid]["images"], strict=True):
            assert np.abs(mine.astype(int) - theirs.astype(int)).max() <= 2, rid
        assert compiled[rid]["cache"] == eager[rid]["cache"], rid
        skipped += (compiled[rid]["cache"] or {}).get("steps_skipped", 0)
    assert skipped > 0, "no block-cache skip happened"

    for stage in (compiled_stage, eager_stage):
        samples = metric_samples(httpx.get(f"{stage.http_url}/metrics", timeout=30).text)
        assert samples[("diffstage_preemptions_total", ())] >= 1, "the high-priority request preempted nothing"
    samples = metric_samples(httpx.get(f"{compiled_stage.http_url}/metrics", timeout=30).text)
    assert samples[("diffstage_compile_graphs", (("rank", "0"),))] == graphs
    assert samples[("diffstage_compile_recompiles_total", (("rank", "0"),))] == 0
    assert samples[("diffstage_compile_fallback", (("rank", "0"),))] == 0
