"""The operator's probe of a stage pod reads the adapters it has loaded (/v1/loras) into the replica's status."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from stage_operator.health import HealthBook, ProbeResult
from stage_operator.stage_http import probe


async def _start(app: web.Application) -> tuple[web.AppRunner, str]:
    """The app on a loopback port: its runner (to clean up) and base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


async def _serve(loras_status: int):
    app = web.Application()
    app.router.add_get("/health", lambda r: web.json_response({"status": "ok"}))
    app.router.add_get("/v1/stats", lambda r: web.json_response({"state": "ready", "waiting": 0, "running": 1}))
    app.router.add_get("/v1/loras", lambda r: web.json_response(
        {"object": "list", "data": [{"name": "pixel-art"}, {"name": "ink"}], "max_loras": 8}, status=loras_status))
    return await _start(app)


async def test_the_probe_lists_the_loaded_adapters_and_the_book_shows_a_change():
    runner, base = await _serve(200)
    try:
        async with aiohttp.ClientSession() as session:
            result = await probe(session, base, 5)
    finally:
        await runner.cleanup()
    assert result.loras == ("pixel-art", "ink") and result.running == 1
    book = HealthBook()
    health, changed = book.record("uid", result)
    assert changed and health.loras == ("pixel-art", "ink")
    _, changed = book.record("uid", result)
    assert not changed


async def test_a_stage_without_the_route_reports_no_list():
    runner, base = await _serve(404)
    try:
        async with aiohttp.ClientSession() as session:
            result = await probe(session, base, 5)
    finally:
        await runner.cleanup()
    assert result.loras is None and result.error is None


async def test_with_an_api_key_the_loras_call_carries_it():
    seen = []
    app = web.Application()
    app.router.add_get("/health", lambda r: web.json_response({"status": "ok"}))
    app.router.add_get("/v1/stats", lambda r: web.json_response({"state": "ready", "waiting": 0, "running": 0}))

    async def loras(request):
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"object": "list", "data": [{"name": "ink"}], "max_loras": 8})

    app.router.add_get("/v1/loras", loras)
    runner, base = await _start(app)
    try:
        async with aiohttp.ClientSession() as session:
            result = await probe(session, base, 5, "k3y")
    finally:
        await runner.cleanup()
    assert result.loras == ("ink",) and seen == ["Bearer k3y"]


async def test_the_probe_reads_the_video_jobs_a_stage_with_a_store_reports():
    app = web.Application()
    app.router.add_get("/health", lambda r: web.json_response({"status": "ok"}))
    app.router.add_get("/v1/stats", lambda r: web.json_response(
        {"state": "ready", "waiting": 0, "running": 1,
         "jobs": {"here": 1, "queued": 2, "in_progress": 3, "completed": 4, "failed": 0}}))
    runner, base = await _start(app)
    try:
        async with aiohttp.ClientSession() as session:
            result = await probe(session, base, 5)
    finally:
        await runner.cleanup()
    assert result.jobs == {"here": 1, "queued": 2, "in_progress": 3, "completed": 4, "failed": 0}
    health, changed = HealthBook().record("uid", result)
    assert changed and health.jobs_here == 1


async def _probe_stats(stats: dict):
    app = web.Application()
    app.router.add_get("/health", lambda r: web.json_response({"status": "ok"}))
    app.router.add_get("/v1/stats", lambda r: web.json_response(stats))
    runner, base = await _start(app)
    try:
        async with aiohttp.ClientSession() as session:
            return await probe(session, base, 5)
    finally:
        await runner.cleanup()


async def test_the_probe_reads_the_compile_report_and_a_fallback_wakes_the_reconcile():
    compiled = {"mode": "regional", "mode_effective": "regional", "reason": None, "auto": None, "warm": True,
                "graphs": 4, "recompiles": 0, "graph_limit_reached": False, "cold_compile_s": 12.3, "cache": "miss",
                "eager_calls": {"lora": 2}, "ranks": [{"rank": 0, "graphs": 4}]}  # serve/model_views.py's keys
    result = await _probe_stats({"state": "ready", "waiting": 0, "running": 0, "compile": compiled})
    assert result.compile == {"mode": "regional", "mode_effective": "regional", "reason": None, "auto": None,
                              "graphs": 4, "recompiles": 0, "graph_limit_reached": False, "cold_compile_s": 12.3,
                              "cache": "miss"}
    book = HealthBook()
    _, changed = book.record("uid", result)
    assert changed
    fell_back = await _probe_stats({"state": "ready", "waiting": 0, "running": 0, "compile": {
        **compiled, "mode_effective": "none", "reason": "inductor failed: no C compiler", "graphs": 0}})
    health, changed = book.record("uid", fell_back)
    assert changed and health.compile["reason"] == "inductor failed: no C compiler"
    _, changed = book.record("uid", fell_back)
    assert not changed
    health, _ = book.record("uid", ProbeResult(2.0, error="ClientConnectorError"))
    assert health.health == "Unreachable" and health.compile == fell_back.compile, "one missed probe forgets nothing"


async def test_a_stage_that_compiles_nothing_reports_no_compile():
    result = await _probe_stats({"state": "ready", "waiting": 0, "running": 0})
    assert result.compile is None and result.error is None
    waiting = await _probe_stats({"state": "starting", "waiting": 0, "running": 0, "compile": {
        "mode": "auto", "mode_effective": None, "reason": None, "warm": False, "ranks": []}})
    assert waiting.compile is None, "no rank has reported yet (mode_effective null): no report"
