"""``GET /v1/models`` and ``GET /v1/models/{id}``: the one served model, with its family's facts.

OpenAI's Model object (``id``, ``object``, ``created``, ``owned_by``) plus ``diffstage``: the loaded
model's ModelInfo (pipeline class, adapter, defaults, limits, modes, parallel kinds, guidance, edit tasks).
The id is ``--served-name``, else the model folder's name.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import PurePath
from typing import Any

from aiohttp import web

from stage_runtime.errors import StageUnavailableError
from stage_runtime.serve.images import SERVICE
from stage_runtime.serve.service import StageService

_STARTED = int(time.time())


def model_id(service: StageService) -> str:
    return service.served_name or PurePath(service.config.model.path).name or service.config.model.path


def model_card(service: StageService) -> dict[str, Any]:
    if service.engine is None:
        raise StageUnavailableError("the stage is starting; the model is not loaded yet")
    info = service.engine.model_info
    facts = {**dataclasses.asdict(info), "supports_edits": info.supports_edits,
             "execution_mode": service.engine.scheduler.mode}
    return {"id": model_id(service), "object": "model", "created": _STARTED, "owned_by": "diffstage",
            "diffstage": facts}


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [model_card(request.app[SERVICE])]})


async def get_model(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    wanted = request.match_info["model_id"]
    if wanted != model_id(service):
        return web.json_response({"error": {"type": "not_found", "message": f"model {wanted!r} is not served here "
                                            f"(this stage serves {model_id(service)!r})", "param": "model"}},
                                 status=404)
    return web.json_response(model_card(service))
