"""``GET /openapi.json``: the OpenAPI 3.1 document of every route, generated from the pydantic schemas.

Nothing here is hand-written schema: request bodies are ``model_json_schema()`` of the edge models
(the edit form adds its file parts as ``format: binary``), responses of the response models below.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from stage_runtime.errors import (DiffStageError, EngineDeadError, InvalidRequestError, QueueFullError,
                                  RequestAbortedError, RequestFailedError, RequestTooLargeError, StageUnavailableError,
                                  UnauthorizedError)
from stage_runtime.jobs import routes as jobs_route
from stage_runtime.playground import route as playground_route
from stage_runtime.serve import admin_route
from stage_runtime.serve.auth import PROTECTED_PATHS
from stage_runtime.serve.loras_route import LoraAdapter, LoraList, LoraLoadBody, LoraUnloaded, openapi_paths
from stage_runtime.serve.schemas import AbortBody, ImageEditRequest, ImageGenerationRequest, StageStats
from stage_runtime.serve.videos import VideoGenerationRequest

REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    type: str
    message: str
    param: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ImageData(BaseModel):
    b64_json: str


class ImagesResponse(BaseModel):
    id: str
    created: int
    data: list[ImageData]
    output_format: Literal["png", "jpeg", "webp"]
    size: str
    quality: str
    background: str
    cache: dict[str, int | bool] | None = None   # steps_computed, steps_skipped, result_cache_hit (when used)


class AbortResult(BaseModel):
    aborted: list[str]
    not_found: list[str]


class RequestInfo(BaseModel):
    request_id: str
    state: str
    step: int
    num_steps: int
    steps_computed: int | None = None       # block cache on (step mode: so far)
    steps_skipped: int | None = None


class RequestsList(BaseModel):
    requests: list[RequestInfo]


class ModelCard(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    diffstage: dict[str, Any]


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class HealthStatus(BaseModel):
    status: str
    state: str | None = None


MODELS = (ErrorResponse, ImagesResponse, AbortResult, RequestsList, ModelCard, ModelList, HealthStatus, StageStats,
          ImageGenerationRequest, VideoGenerationRequest, AbortBody, LoraLoadBody, LoraAdapter, LoraList, LoraUnloaded,
          *jobs_route.OPENAPI_MODELS)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(model)}}


def _responses(ok: type[BaseModel] | None, *errors: type[DiffStageError] | int,
               ok_types: dict | None = None) -> dict[str, Any]:
    """200 and the status of each error the route answers (a class of the tree, or a plain HTTP status)."""
    out: dict[str, Any] = {"200": {"description": "OK", "content": ok_types or _json(ok)}}
    for error in errors:
        out[str(error if isinstance(error, int) else error.http_status)] = {"description": "error",
                                                                            "content": _json(ErrorResponse)}
    return out


def edit_form_schema() -> dict[str, Any]:
    schema = ImageEditRequest.model_json_schema(ref_template=REF)
    binary = {"type": "string", "format": "binary"}
    schema["properties"] = {"image": binary, "mask": binary, **schema["properties"]}
    schema["required"] = ["image", *schema.get("required", [])]
    return schema


def openapi_document(api_keys: bool) -> dict[str, Any]:
    components: dict[str, Any] = {}
    for model in MODELS:
        schema = model.model_json_schema(ref_template=REF)
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
    components["ImageEditForm"] = edit_form_schema()
    components.update(components["ImageEditForm"].pop("$defs", {}))
    components["VideoJobForm"] = jobs_route.form_schema()
    images_out = {**_json(ImagesResponse), "text/event-stream": {"schema": {"type": "string"}}}
    v1 = (UnauthorizedError,) if api_keys else ()
    image_errors = (InvalidRequestError, RequestAbortedError, RequestTooLargeError, QueueFullError, RequestFailedError,
                    StageUnavailableError, *v1)
    paths = {
        "/v1/images/generations": {"post": {
            "operationId": "createImage", "requestBody": {"required": True, "content": _json(ImageGenerationRequest)},
            "responses": _responses(None, *image_errors, ok_types=images_out)}},
        "/v1/images/edits": {"post": {
            "operationId": "createImageEdit", "requestBody": {"required": True, "content": {
                "multipart/form-data": {"schema": {"$ref": REF.format(model="ImageEditForm")}}}},
            "responses": _responses(None, *image_errors, ok_types=images_out)}},
        "/v1/videos/sync": {"post": {
            "operationId": "createVideoSync", "requestBody": {"required": True, "content": _json(VideoGenerationRequest)},
            "responses": _responses(None, *image_errors, ok_types={
                "video/mp4": {"schema": {"type": "string", "format": "binary"}},
                "application/zip": {"schema": {"type": "string", "format": "binary"}}})}},
        "/v1/abort": {"post": {"operationId": "abort", "requestBody": {"required": True, "content": _json(AbortBody)},
                               "responses": _responses(AbortResult, InvalidRequestError, RequestTooLargeError, *v1)}},
        "/v1/stats": {"get": {"operationId": "stats", "responses": _responses(StageStats, *v1)}},
        "/v1/requests": {"get": {"operationId": "listRequests", "responses": _responses(RequestsList, *v1)}},
        "/v1/models": {"get": {"operationId": "listModels",
                               "responses": _responses(ModelList, StageUnavailableError, *v1)}},
        "/v1/models/{model_id}": {"get": {
            "operationId": "retrieveModel",
            "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": _responses(ModelCard, 404, StageUnavailableError, *v1)}},
        **jobs_route.openapi_paths(_responses, _json, REF, v1),
        **openapi_paths(_responses, _json, v1),
        **admin_route.openapi_paths(_responses, v1),
        "/health": {"get": {"operationId": "health", "responses": _responses(HealthStatus, EngineDeadError)}},
        "/ready": {"get": {"operationId": "ready", "responses": _responses(HealthStatus, StageUnavailableError)}},
        "/metrics": {"get": {"operationId": "metrics", "responses": {"200": {
            "description": "Prometheus text", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        **playground_route.openapi_paths(REF.format(model="ErrorResponse")),
    }
    doc: dict[str, Any] = {"openapi": "3.1.0", "info": {"title": "diffstage stage", "version": "v1"},
                           "paths": paths, "components": {"schemas": components}}
    if api_keys:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in paths.items():
            if path.startswith("/v1/") or path in PROTECTED_PATHS:
                for op in item.values():
                    op["security"] = [{"bearer": []}]
    return doc
