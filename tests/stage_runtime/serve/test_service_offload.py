"""Offload accounting reaches /v1/stats and /metrics: a real engine with the disk offloader, polled in the
background by the StageService (the stats route never waits for an RPC)."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families
from support.waiting import async_wait_until

from stage_runtime.config import load_config
from stage_runtime.engine.engine import DiffusionEngine
from stage_runtime.serve.metrics import StageMetrics
from stage_runtime.serve.service import StageService


async def test_offload_stats_in_stats_and_metrics(tiny_sd_path):
    config = load_config({"model": {"path": tiny_sd_path}, "device": "cpu", "offload": {"mode": "model"}})
    engine = await asyncio.to_thread(DiffusionEngine.make_engine, config)
    service = StageService(config, StageMetrics())
    try:
        service.attach(engine)
        await async_wait_until(lambda: service.offload is not None, 30, what="the first offload poll")
        stats = service.stats()
        (rank0,) = stats["offload"]
        assert rank0["rank"] == 0 and rank0["mode"] == "model" and rank0["tier"] == "cpu<->disk"
        assert rank0["loads"] > 0                                  # the warmup request brought units in
        text = service.metrics.render(stats).decode()
        got = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
        assert got[("diffstage_offload_resident_bytes", (("rank", "0"), ("tier", "disk")))] > 0
        assert got[("diffstage_offload_transfers", (("kind", "loads"), ("rank", "0")))] == rank0["loads"]
        assert got[("diffstage_offload_peak_resident_bytes", (("rank", "0"),))] == rank0["peak_resident_bytes"]
    finally:
        await asyncio.to_thread(engine.close)
        if service._offload_task is not None:
            await asyncio.wait_for(service._offload_task, 5)       # ends once the engine is closed


def test_no_offload_key_when_offload_is_off():
    config = load_config({"model": {"path": "/unused"}, "device": "cpu"})
    assert "offload" not in StageService(config, StageMetrics()).stats()
