"""``GET /``, ``GET /playground`` (the page) and ``GET /playground/assets/{name}`` (its scripts and style).

The files are read once, when the routes are added; an asset not shipped is a 404. Every answer carries the
same headers: a Content-Security-Policy that allows scripts, styles and connections to this origin only (no
inline script, no ``eval``, no frame, no form target, no ``<base>``), images and media from this origin or from
``data:`` / ``blob:`` URLs the page makes of what the API answered, ``nosniff``, no referrer, no framing. The
page and its assets hold no secret and are open on a keyed stage: the API calls they make need the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aiohttp import web

STATIC = Path(__file__).resolve().parent / "static"
ASSET_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
               ".svg": "image/svg+xml"}
PAGE_PATHS = ("/", "/playground")
ASSET_PREFIX = "/playground/assets/"
CSP = "; ".join((
    "default-src 'none'", "script-src 'self'", "style-src 'self'", "connect-src 'self'",
    "img-src 'self' data: blob:", "media-src 'self' blob:", "base-uri 'none'", "form-action 'none'",
    "frame-ancestors 'none'",
))
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "X-Frame-Options": "DENY", "Cross-Origin-Opener-Policy": "same-origin", "Cache-Control": "no-cache"}


def page_url(host: str, port: int) -> str:
    """The page's URL for a person on this machine: a wildcard listen address is reached as localhost."""
    shown = "localhost" if host in ("0.0.0.0", "::", "") else f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/"


def asset_files(folder: Path = STATIC) -> list[Path]:
    """The page's scripts and styles (every shipped file but the page itself), by name."""
    return sorted(path for path in folder.iterdir() if path.suffix in ASSET_TYPES)


def read_assets(folder: Path = STATIC) -> tuple[bytes, dict[str, tuple[bytes, str]]]:
    """The page, and every asset by file name with its content type."""
    assets = {path.name: (path.read_bytes(), ASSET_TYPES[path.suffix]) for path in asset_files(folder)}
    return (folder / "index.html").read_bytes(), assets


def add_routes(app: web.Application) -> None:
    page, assets = read_assets()

    async def serve_page(request: web.Request) -> web.Response:
        return web.Response(body=page, headers={**HEADERS, "Content-Type": "text/html; charset=utf-8"})

    async def serve_asset(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in assets:
            raise web.HTTPNotFound(reason=f"the playground ships no asset {name!r}")
        body, content_type = assets[name]
        return web.Response(body=body, headers={**HEADERS, "Content-Type": content_type})

    for path in PAGE_PATHS:
        app.router.add_get(path, serve_page)
    app.router.add_get(ASSET_PREFIX + "{name}", serve_asset)


def openapi_paths(error_ref: str) -> dict[str, Any]:
    """The page and its assets in ``/openapi.json`` (present unless ``--no-playground``; open on a keyed stage)."""
    missing = {"description": "not shipped, or the playground is off (--no-playground)",
               "content": {"application/json": {"schema": {"$ref": error_ref}}}}
    page = {"get": {"operationId": "playground", "responses": {
        "200": {"description": "the playground page", "content": {"text/html": {"schema": {"type": "string"}}}},
        "404": missing}}}
    names = [path.name for path in asset_files()]
    asset = {"get": {"operationId": "playgroundAsset", "parameters": [
        {"name": "name", "in": "path", "required": True, "schema": {"type": "string", "enum": names}}],
        "responses": {"200": {"description": "a script or style of the page",
                              "content": {t: {"schema": {"type": "string"}} for t in sorted(set(ASSET_TYPES.values()))}},
                      "404": missing}}}
    return {**{path: page for path in PAGE_PATHS}, ASSET_PREFIX + "{name}": asset}
