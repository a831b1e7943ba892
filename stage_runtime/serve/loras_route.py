"""``/v1/loras``: the stage's LoRA adapters at run time (docs/lora.md).

    GET    /v1/loras            {"object": "list", "data": [adapter...], "max_loras"}
    POST   /v1/loras            {"name", "path", "pinned"?} → the adapter; 400 when the file does not fit
                                (names the adapter and the first bad key), 409 name taken / max_loras full
    DELETE /v1/loras/{name}     {"name", "unloaded": true}; 404 unknown, 409 while in-flight requests use it

Each call goes through the engine's adapter table (the declared control RPCs ``list_loras``,
``load_lora``, ``unload_lora``: the same path a ZMQ ``collective_rpc`` takes), ordered with the waves.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from stage_runtime.errors import (DiffStageError, LoraConflictError, LoraLoadError, LoraNotFoundError,
                                  StageUnavailableError)
from stage_runtime.request import LORA_NAME_PATTERN
from stage_runtime.serve.bodies import read_json
from stage_runtime.serve.images import SERVICE
from stage_runtime.serve.schemas import parse_body


class LoraLoadBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    name: str = Field(pattern=LORA_NAME_PATTERN)
    path: str = Field(min_length=1, max_length=4096)      # inside the stage: image or volume, never a URL
    pinned: bool = False                                  # pinned: never evicted for max_loras


class LoraAdapter(BaseModel):
    name: str
    path: str
    digest: str
    pinned: bool
    rank: int
    modules: dict[str, int]
    in_use: int
    requests_total: int
    evicted: str | None = None         # POST only: the adapter evicted to make room (max_loras)


class LoraList(BaseModel):
    object: str = "list"
    data: list[LoraAdapter]
    max_loras: int


class LoraUnloaded(BaseModel):
    name: str
    unloaded: bool


def _engine(request: web.Request):
    service = request.app[SERVICE]
    if service.engine is None:
        raise StageUnavailableError("the stage is starting; no adapters can be managed yet")
    return service


async def _rpc(request: web.Request, method: str, *args: Any) -> Any:
    service = _engine(request)
    return await asyncio.to_thread(service.collective_rpc, method, args, {}, None, None)


async def list_loras(request: web.Request) -> web.Response:
    service = _engine(request)
    data = await _rpc(request, "list_loras")
    return web.json_response({"object": "list", "data": data, "max_loras": service.config.max_loras})


async def load_lora(request: web.Request) -> web.Response:
    body = parse_body(LoraLoadBody, await read_json(request))
    return web.json_response(await _rpc(request, "load_lora", body.name, body.path, body.pinned))


async def unload_lora(request: web.Request) -> web.Response:
    return web.json_response(await _rpc(request, "unload_lora", request.match_info["name"]))


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/loras", list_loras)
    app.router.add_post("/v1/loras", load_lora)
    app.router.add_delete("/v1/loras/{name}", unload_lora)


def openapi_paths(responses, json_body, v1: tuple[type[DiffStageError], ...]) -> dict[str, Any]:
    name = [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}]
    return {
        "/v1/loras": {
            "get": {"operationId": "listLoras", "responses": responses(LoraList, StageUnavailableError, *v1)},
            "post": {"operationId": "loadLora", "requestBody": {"required": True, "content": json_body(LoraLoadBody)},
                     "responses": responses(LoraAdapter, LoraLoadError, LoraConflictError, StageUnavailableError,
                                            *v1)}},
        "/v1/loras/{name}": {"delete": {"operationId": "unloadLora", "parameters": name,
                                        "responses": responses(LoraUnloaded, LoraNotFoundError, LoraConflictError,
                                                               StageUnavailableError, *v1)}},
    }
