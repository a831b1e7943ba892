"""API keys (``--api-key-file``): every ``/v1/*`` route and the admin routes of sleep mode and the profiler need
``Authorization: Bearer <key>``.

The file holds one key a line (blank lines and ``#`` comments ignored); it is read once at startup and a
file with no key is a configuration error (exit 2). A key is compared with every configured key in
constant time (``hmac.compare_digest``, no early exit). ``/health``, ``/ready``, ``/metrics`` and
``/openapi.json`` stay open (probes, scraping, documentation). A missing or wrong key is 401
``unauthorized`` with ``WWW-Authenticate: Bearer``.
"""

from __future__ import annotations

import hmac
from pathlib import Path

from aiohttp import web

from stage_runtime.errors import ConfigError, UnauthorizedError
from stage_runtime.serve.schemas import error_body

PROTECTED_PREFIX = "/v1/"
# the admin routes of sleep mode and the profiler (serve.admin_route): vLLM's paths, outside /v1/, keyed as well
PROTECTED_PATHS = ("/sleep", "/wake_up", "/is_sleeping", "/start_profile", "/stop_profile")


def load_api_keys(path: str) -> tuple[bytes, ...]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"server.api_key_file={path!r}: cannot read it ({exc})") from None
    keys = tuple(line.strip().encode() for line in text.splitlines() if line.strip() and not line.startswith("#"))
    if not keys:
        raise ConfigError(f"server.api_key_file={path!r}: no key in the file (one key a line)")
    return keys


def key_matches(given: bytes, keys: tuple[bytes, ...]) -> bool:
    found = False
    for key in keys:                       # every key is compared: the time does not say which one matched
        found |= hmac.compare_digest(given, key)
    return found


def bearer_auth(keys: tuple[bytes, ...]):
    @web.middleware
    async def check_key(request: web.Request, handler):
        if request.path.startswith(PROTECTED_PREFIX) or request.path in PROTECTED_PATHS:
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not key_matches(token.strip().encode(), keys):
                why = "a wrong API key" if token else "no API key (Authorization: Bearer <key>)"
                return web.json_response(error_body(UnauthorizedError.error_type,
                                                    f"{why}: this stage requires an API key"),
                                         status=UnauthorizedError.http_status, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return check_key
