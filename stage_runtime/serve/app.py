"""The stage's HTTP surface (aiohttp): routes of docs/http-api.md and JSON errors for every failure.

Errors are ``{"error": {"type", "message"}}`` (+ ``param`` on a 400), with the status of the error
tree (each class's ``http_status``, ``stage_runtime.errors``); 429 carries Retry-After.
"""

from __future__ import annotations

import logging

from aiohttp import web

from stage_runtime.errors import (DiffStageError, EngineDeadError, InvalidRequestError, QueueFullError,
                                  RequestTooLargeError, StageUnavailableError)
from stage_runtime.serve.admin_route import add_routes as add_admin_routes
from stage_runtime.serve.auth import bearer_auth
from stage_runtime.serve.bodies import read_json
from stage_runtime.serve.images import SERVICE, create_edits, create_images
from stage_runtime.jobs.runner import JobRunner
from stage_runtime.jobs.routes import JOBS
from stage_runtime.jobs.routes import add_routes as add_job_routes
from stage_runtime.serve.videos import create_video_sync
from stage_runtime.serve.loras_route import add_routes as add_lora_routes
from stage_runtime.serve.metrics import CONTENT_TYPE_LATEST
from stage_runtime.serve.models_route import get_model, list_models
from stage_runtime.serve.openapi import openapi_document
from stage_runtime.playground.route import add_routes as add_playground_routes
from stage_runtime.serve.schemas import AbortBody, error_body, parse_body
from stage_runtime.serve.service import StageService
from stage_runtime.serve.wire import error_type_of, status_of

log = logging.getLogger(__name__)
_HTTP_TYPES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def error_response(exc: DiffStageError, service: StageService) -> web.Response:
    error_type = error_type_of(exc)
    param = exc.field if isinstance(exc, (InvalidRequestError, RequestTooLargeError)) else None
    retry = getattr(exc, "retry_after_s", None) or (service.retry_after() if isinstance(exc, QueueFullError) else None)
    headers = {"Retry-After": str(retry)} if retry else None
    return web.json_response(error_body(error_type, str(exc), param), status=status_of(error_type),
                             headers=headers)


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except DiffStageError as exc:
        return error_response(exc, request.app[SERVICE])
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return web.json_response(error_body(_HTTP_TYPES.get(exc.status, "http_error"), exc.reason),
                                 status=exc.status)
    except Exception as exc:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return web.json_response(error_body("internal_error", f"{type(exc).__name__}: {exc}"), status=500)


async def abort(request: web.Request) -> web.Response:
    body = parse_body(AbortBody, await read_json(request)).check()
    return web.json_response(request.app[SERVICE].abort(body.request_ids, all=body.all))


def stage_stats(app: web.Application, work: dict | None = None) -> dict:
    """``/v1/stats``: the service's, and ``jobs`` when the stage keeps video jobs (``--job-store``)."""
    jobs = app.get(JOBS)
    return {**app[SERVICE].stats(work), **({"jobs": jobs.stats()} if jobs is not None else {})}


async def stats(request: web.Request) -> web.Response:
    return web.json_response(stage_stats(request.app))


async def requests(request: web.Request) -> web.Response:
    return web.json_response({"requests": request.app[SERVICE].requests()})


async def health(request: web.Request) -> web.Response:
    """Liveness: 200 while the engine is alive (also while starting or draining), 503 once it is dead."""
    service = request.app[SERVICE]
    if service.dead_reason is not None:
        return web.json_response(error_body(EngineDeadError.error_type, f"Engine is dead: {service.dead_reason}"),
                                 status=EngineDeadError.http_status)
    return web.json_response({"status": "ok", "state": service.state})


async def ready(request: web.Request) -> web.Response:
    """Readiness: 200 only after warmup while admitting work; 503 while starting, stalled, draining or dead."""
    service = request.app[SERVICE]
    state, unavailable, status = service.state, StageUnavailableError.error_type, StageUnavailableError.http_status
    if state == "starting":           # loading: say what it is doing (phase, seconds so far)
        view = service.startup.view()
        body = error_body(unavailable, f"the stage is loading: {service.startup.describe()}")
        return web.json_response({**body, "state": "loading", "phase": view["phase"], "detail": view["detail"],
                                  "elapsed_s": view["elapsed_s"]}, status=status)
    if state == "stalled":            # the watchdog: out of the Service until the step moves again
        reason = service.engine.stall_reason or "progress resumed"
        return web.json_response({**error_body(unavailable, f"the stage is stalled: {reason}"),
                                  "state": "stalled"}, status=status)
    if state != "ready":
        return web.json_response(error_body(unavailable, f"the stage is {state}"), status=status)
    return web.json_response({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    work = service.work()
    if service.engine is not None:
        service.metrics.observe_loras(service.engine.loras.metrics(), work["waiting_loras"])
    return web.Response(body=service.metrics.render(stage_stats(request.app, work)),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _openapi(document: dict) -> web.Response:
    return web.json_response(document)


def build_app(service: StageService, api_keys: tuple[bytes, ...] = (), jobs: JobRunner | None = None) -> web.Application:
    """The routes; with ``api_keys`` every /v1/* route needs one of them as a Bearer token. Without ``jobs`` (no
    ``--job-store``) the /v1/videos job routes answer 404 jobs_not_configured. The playground page is at ``/``
    unless ``server.playground`` is off."""
    middlewares = [json_errors] + ([bearer_auth(api_keys)] if api_keys else [])
    app = web.Application(middlewares=middlewares, client_max_size=service.config.server.max_upload_bytes)
    app[SERVICE] = service
    if jobs is not None:
        app[JOBS] = jobs
    app.router.add_post("/v1/images/generations", create_images)
    app.router.add_post("/v1/images/edits", create_edits)
    app.router.add_post("/v1/videos/sync", create_video_sync)
    add_job_routes(app)
    app.router.add_post("/v1/abort", abort)
    app.router.add_get("/v1/stats", stats)
    app.router.add_get("/v1/requests", requests)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model_id}", get_model)
    add_lora_routes(app)
    add_admin_routes(app)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    document = openapi_document(bool(api_keys))
    app.router.add_get("/openapi.json", lambda request: _openapi(document))
    if service.config.server.playground:
        add_playground_routes(app)
    return app
