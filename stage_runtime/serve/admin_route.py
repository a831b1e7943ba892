"""The admin routes of sleep mode and the profiler, in vLLM's shapes (docs/http-api.md#sleep-and-profile):

    POST /sleep?level=1|2[&abort=true][&drain_timeout_s=S]   the stage sleeps (every rank); its state
    POST /wake_up                                            every rank's weights back; its state
    GET  /is_sleeping                                        {"is_sleeping": bool, "level": n|null}
    POST /start_profile                                      torch.profiler on every rank: {profile_id, dir, ...}
    POST /stop_profile                                       the traces written: {profile_id, files: [...]}

Behind the API key when the stage has one (serve.auth); 404 while the feature is off (``--enable-sleep-mode``,
``--profiler-dir``). A generation request that reaches a sleeping stage wakes it (serve.wake).
"""

from __future__ import annotations

import asyncio
import math

from aiohttp import web

from stage_runtime.errors import InvalidRequestError, StageBusyError, StageUnavailableError
from stage_runtime.serve.images import SERVICE

SLEEP_PATHS = ("/sleep", "/wake_up", "/is_sleeping")
PROFILE_PATHS = ("/start_profile", "/stop_profile")
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def _engine(request: web.Request, feature: str):
    service = request.app[SERVICE]
    config = service.config
    enabled = config.sleep.enabled if feature == "sleep" else config.profiler.enabled
    if not enabled:
        how = "serve --enable-sleep-mode" if feature == "sleep" else "serve --profiler-dir DIR"
        raise web.HTTPNotFound(reason=f"{request.path}: {feature} is off on this stage ({how})")
    if service.engine is None:
        raise StageUnavailableError("the stage is starting; the model is not loaded yet")
    return service.engine


def _query_level(request: web.Request) -> int:
    raw = request.query.get("level", "1")
    if raw not in ("1", "2"):
        raise InvalidRequestError("level", raw, "sleep levels are 1 (weights to host memory) and 2 (weights dropped, "
                                  "read again from the model source on wake)")
    return int(raw)


def _query_bool(request: web.Request, name: str) -> bool:
    raw = request.query.get(name, "false").lower()
    if raw not in _TRUE + _FALSE:
        raise InvalidRequestError(name, raw, "give true or false")
    return raw in _TRUE


def _query_seconds(request: web.Request, name: str) -> float | None:
    raw = request.query.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 3600:
        raise InvalidRequestError(name, raw, "seconds from 0 to 3600")
    return value


async def sleep(request: web.Request) -> web.Response:
    engine = _engine(request, "sleep")
    level, abort = _query_level(request), _query_bool(request, "abort")
    drain = _query_seconds(request, "drain_timeout_s")
    return web.json_response(await asyncio.to_thread(engine.sleep.sleep, level, abort, drain))


async def wake_up(request: web.Request) -> web.Response:
    engine = _engine(request, "sleep")
    return web.json_response(await asyncio.to_thread(engine.sleep.wake))


async def is_sleeping(request: web.Request) -> web.Response:
    control = _engine(request, "sleep").sleep
    return web.json_response({"is_sleeping": control.is_sleeping, "level": control.level})


async def start_profile(request: web.Request) -> web.Response:
    engine = _engine(request, "profiler")
    return web.json_response(await asyncio.to_thread(engine.profiler.start))


async def stop_profile(request: web.Request) -> web.Response:
    engine = _engine(request, "profiler")
    return web.json_response(await asyncio.to_thread(engine.profiler.stop))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/sleep", sleep)
    app.router.add_post("/wake_up", wake_up)
    app.router.add_get("/is_sleeping", is_sleeping)
    app.router.add_post("/start_profile", start_profile)
    app.router.add_post("/stop_profile", stop_profile)


def openapi_paths(responses, v1: tuple) -> dict:
    """The admin routes in the stage's OpenAPI document (their answers are plain JSON objects)."""
    obj = {"application/json": {"schema": {"type": "object"}}}
    level = [{"name": "level", "in": "query", "schema": {"type": "integer", "enum": [1, 2], "default": 1}},
             {"name": "abort", "in": "query", "schema": {"type": "boolean", "default": False}},
             {"name": "drain_timeout_s", "in": "query", "schema": {"type": "number", "minimum": 0, "maximum": 3600}}]
    return {
        "/sleep": {"post": {"operationId": "sleep", "parameters": level,
                            "responses": responses(None, InvalidRequestError, StageBusyError, 404, *v1,
                                                   ok_types=obj)}},
        "/wake_up": {"post": {"operationId": "wakeUp", "responses": responses(None, 404, *v1, ok_types=obj)}},
        "/is_sleeping": {"get": {"operationId": "isSleeping", "responses": responses(None, 404, *v1, ok_types=obj)}},
        "/start_profile": {"post": {"operationId": "startProfile",
                                    "responses": responses(None, StageBusyError, 404, *v1, ok_types=obj)}},
        "/stop_profile": {"post": {"operationId": "stopProfile",
                                   "responses": responses(None, StageBusyError, 404, *v1, ok_types=obj)}},
    }
