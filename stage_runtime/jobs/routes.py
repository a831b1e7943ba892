"""``/v1/videos``: OpenAI's video job API, as ``client.videos`` of the official SDK calls it, over the shared store.

    POST   /v1/videos                      create (multipart as the SDK sends it, or JSON): 200 the queued Video
    GET    /v1/videos/{id}                 the Video: status, progress from the run's phase and step, times, error
    GET    /v1/videos?after&limit&order    a page of Videos in creation order (``desc`` by default)
    DELETE /v1/videos/{id}                 gone at once; a run stops at its next step
    GET    /v1/videos/{id}/content         ?variant=video (MP4) | thumbnail (PNG) | frames (zip of exact PNGs)
                                           | audio (WAV: the sound track alone, for a model that makes one)

Any replica answers every route for every job of the store (records and files are in the shared folder); a
create is checked as the engine would admit it (the model's frame rule, size, prompt length, reference, cost)
and refused with a 400 before anything is stored. Every answer carries ``openai-poll-after-ms``. Without
``--job-store`` every route answers 404 ``jobs_not_configured``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel

from stage_runtime.errors import (DiffStageError, InvalidRequestError, JobNotFoundError, JobNotReadyError,
                                  JobsNotConfiguredError, JobStoreError, RequestTooLargeError, StageUnavailableError)
from stage_runtime.imageio import encode_png
from stage_runtime.jobs.content import CONTENT_TYPES, send_content
from stage_runtime.jobs.record import JOB_ID, JobError, JobRecord
from stage_runtime.jobs.store import OUTPUTS, REFERENCE, VIDEO_INPUT
from stage_runtime.serve.images import SERVICE, check_model
from stage_runtime.jobs.form import VideoJobRequest, new_record, read_job_body
from stage_runtime.jobs.runner import JobRunner
from stage_runtime.serve.models_route import model_id

log = logging.getLogger(__name__)

JOBS = web.AppKey("jobs", JobRunner)
MAX_PAGE, DEFAULT_PAGE = 100, 20


def _runner(request: web.Request) -> JobRunner:
    runner = request.app.get(JOBS)
    if runner is None:
        raise JobsNotConfiguredError("the video job API is off on this stage: start it with --job-store DIR "
                                     "(a folder every replica of the stage shares)")
    return runner


def _answer(runner: JobRunner, body: dict[str, Any]) -> web.Response:
    return web.json_response(body, headers={"openai-poll-after-ms": str(runner.config.poll_after_ms)})


async def _record(runner: JobRunner, video_id: str) -> JobRecord:
    """The job's record; 404 for one the store does not hold or that has expired (never ``completed`` for files
    that are about to go)."""
    record = await asyncio.to_thread(runner.store.get, video_id)
    if record is None or record.expired(time.time()):
        raise JobNotFoundError(f"no video job {video_id!r} (never created, deleted, or expired)")
    return record


async def create_job(request: web.Request) -> web.Response:
    runner, service = _runner(request), request.app[SERVICE]
    server = service.config.server
    try:
        body, reference, video = await read_job_body(request, server.max_upload_bytes, server.max_image_pixels)
        check_model(body, service)
    except (InvalidRequestError, RequestTooLargeError) as exc:
        service.metrics.count(exc.outcome)
        raise
    if service.model_info is None:
        raise StageUnavailableError("the stage is starting; the model is not loaded yet")
    checked = service.check(body.video_request("video-create", service.model_info.default_fps, reference,
                                               video_input=video))
    record = new_record(body, checked, model_id(service), time.time())
    files = {} if reference is None else {REFERENCE: encode_png(reference)}
    if video is not None:
        files[VIDEO_INPUT] = await asyncio.to_thread(video.to_bytes)
    await asyncio.to_thread(lambda: runner.store.create(record, files))
    runner.wake()
    return _answer(runner, record.video())


async def get_job(request: web.Request) -> web.Response:
    runner = _runner(request)
    return _answer(runner, (await _record(runner, request.match_info["video_id"])).video())


def _query(request: web.Request) -> tuple[str | None, int, str]:
    query = request.query
    after = query.get("after")
    if after is not None and not JOB_ID.match(after):
        raise InvalidRequestError("after", after, "must be a video id (video_<32 hex digits>)")
    try:
        limit = int(query.get("limit", DEFAULT_PAGE))
    except ValueError:
        raise InvalidRequestError("limit", query["limit"], f"must be an integer from 1 to {MAX_PAGE}") from None
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidRequestError("limit", limit, f"must be an integer from 1 to {MAX_PAGE}")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequestError("order", order, "must be asc or desc")
    return after, limit, order


async def list_jobs(request: web.Request) -> web.Response:
    """A page in creation order; ids sort as they were made, so ``after`` needs no record to still exist."""
    runner = _runner(request)
    after, limit, order = _query(request)
    page, more = await asyncio.to_thread(read_page, runner.store, after, limit, order, time.time())
    return _answer(runner, {"object": "list", "data": [r.video() for r in page],
                            "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None,
                            "has_more": more})


def read_page(store, after: str | None, limit: int, order: str, now: float) -> tuple[list[JobRecord], bool]:
    """(A thread.) The page without a scan: ids are listed as a key range from ``after`` (they sort by creation
    time), a page and one more at a time, and only their records are read (an expired or vanished job is passed
    over, and the range goes on past it)."""
    page: list[JobRecord] = []
    while True:
        ids = store.ids(after=after, limit=limit + 1, order=order)
        for job_id in ids:
            try:
                record = store.get(job_id)
            except JobStoreError as exc:
                log.warning("skipping an unreadable job record: %s", exc)
                continue
            if record is None or record.expired(now):
                continue
            if len(page) == limit:
                return page, True
            page.append(record)
        if len(ids) < limit + 1:
            return page, False
        after = ids[-1]


async def delete_job(request: web.Request) -> web.Response:
    """Out of the store at once (one rename); a run on this replica stops at its next step before the answer, a
    run on another replica at its next step there (its next record write finds the job gone)."""
    runner = _runner(request)
    video_id = request.match_info["video_id"]
    record = await _record(runner, video_id)
    trashed = await asyncio.to_thread(runner.store.delete, video_id)
    if trashed is None:
        raise JobNotFoundError(f"no video job {video_id!r} (deleted meanwhile)")
    stopped = await runner.cancel(video_id)
    await asyncio.to_thread(runner.store.purge, trashed)
    return _answer(runner, {"id": video_id, "object": "video.deleted", "deleted": True,
                            "diffstage": {"status": record.status, "ran_here": stopped is not None, **(stopped or {})}})


async def job_content(request: web.Request) -> web.StreamResponse:
    """The file of a completed job (``jobs.content``: byte ranges, presigned redirects); a delete meanwhile does not
    cut the answer short."""
    runner = _runner(request)
    video_id = request.match_info["video_id"]
    variant = request.query.get("variant", "video")
    if variant not in OUTPUTS:
        raise InvalidRequestError("variant", variant, f"must be one of {', '.join(OUTPUTS)} "
                                                      "(no spritesheet is made here)")
    record = await _record(runner, video_id)
    if record.status != "completed":
        why = f": {record.error.message}" if record.error is not None else f" ({record.progress} %)"
        raise JobNotReadyError(f"video job {video_id} is {record.status}{why}; its content exists once it "
                               "is completed")
    if variant == "audio" and OUTPUTS[variant] not in record.outputs:      # a model without sound
        raise InvalidRequestError("variant", variant, f"video job {video_id} has no {variant} track: its model "
                                                      f"({record.model}) makes none")
    return await send_content(request, runner.store, video_id, variant,
                              {"openai-poll-after-ms": str(runner.config.poll_after_ms)},
                              runner.config.presigned_content, runner.config.presign_expiry_s)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/videos", create_job)
    app.router.add_get("/v1/videos", list_jobs)
    app.router.add_get("/v1/videos/{video_id}", get_job)
    app.router.add_delete("/v1/videos/{video_id}", delete_job)
    app.router.add_get("/v1/videos/{video_id}/content", job_content)


# -- the OpenAPI document's part (serve.openapi) ---------------------------------------------------------------
class VideoJob(BaseModel):
    """OpenAI's ``Video``, plus ``diffstage`` (phase, step, num_steps, num_frames, fps, seed, owner, attempts)."""

    id: str
    object: Literal["video"]
    model: str
    status: Literal["queued", "in_progress", "completed", "failed"]
    progress: int
    created_at: int
    completed_at: int | None
    expires_at: int | None
    error: JobError | None
    prompt: str
    seconds: str
    size: str
    remixed_from_video_id: None = None
    diffstage: dict[str, Any]


class VideoJobList(BaseModel):
    object: Literal["list"]
    data: list[VideoJob]
    first_id: str | None
    last_id: str | None
    has_more: bool


class VideoJobDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"]
    deleted: bool
    diffstage: dict[str, Any]


OPENAPI_MODELS = (VideoJobRequest, VideoJob, VideoJobList, VideoJobDeleted)


def openapi_paths(responses, json_body, ref: str, v1: tuple[type[DiffStageError], ...]) -> dict[str, Any]:
    video_id = [{"name": "video_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    errors = (JobsNotConfiguredError, JobStoreError, *v1)
    binary = {"schema": {"type": "string", "format": "binary"}}
    return {
        "/v1/videos": {
            "post": {"operationId": "createVideo", "requestBody": {"required": True, "content": {
                **json_body(VideoJobRequest), "multipart/form-data": {"schema": {"$ref": ref.format(model="VideoJobForm")}}}},
                     "responses": responses(VideoJob, InvalidRequestError, RequestTooLargeError, StageUnavailableError,
                                            *errors)},
            "get": {"operationId": "listVideos", "parameters": [
                {"name": "after", "in": "query", "schema": {"type": "string"}},
                {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE}},
                {"name": "order", "in": "query", "schema": {"type": "string", "enum": ["asc", "desc"]}}],
                    "responses": responses(VideoJobList, InvalidRequestError, *errors)}},
        "/v1/videos/{video_id}": {
            "get": {"operationId": "retrieveVideo", "parameters": video_id,
                    "responses": responses(VideoJob, JobNotFoundError, *errors)},
            "delete": {"operationId": "deleteVideo", "parameters": video_id,
                       "responses": responses(VideoJobDeleted, JobNotFoundError, *errors)}},
        "/v1/videos/{video_id}/content": {"get": {
            "operationId": "downloadVideoContent", "parameters": [*video_id, {
                "name": "variant", "in": "query", "schema": {"type": "string", "enum": list(OUTPUTS)}}],
            "responses": responses(None, InvalidRequestError, JobNotFoundError, JobNotReadyError, *errors,
                                   ok_types={t: binary for t in CONTENT_TYPES.values()})}},
    }


def form_schema() -> dict[str, Any]:
    """``POST /v1/videos``'s multipart form: the JSON body's fields, ``input_reference`` an uploaded file."""
    schema = VideoJobRequest.model_json_schema()
    schema["properties"]["input_reference"] = {"type": "string", "format": "binary"}
    for name in ("input_video", "mask_video"):                    # video-to-video (Wan VACE)
        schema["properties"][name] = {"type": "string", "format": "binary"}
    schema["properties"]["reference_image"] = {"type": "array", "items": {"type": "string", "format": "binary"}}
    return schema
