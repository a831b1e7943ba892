"""The page and its files as the stage serves them: the same strict headers on each (a Content-Security-Policy with
no inline script, nosniff, no framing); every shipped file is an asset the page names, with no URL outside the
stage and no inline script or handler; an asset that is not shipped is a 404; ``--no-playground`` leaves the routes
out; the page is open on a keyed stage while the API it calls is not."""

from __future__ import annotations

import re

import pytest
from aiohttp.test_utils import TestClient, TestServer

from stage_runtime.cli import build_parser, config_from_args
from stage_runtime.config import load_config
from stage_runtime.playground.route import ASSET_PREFIX, CSP, STATIC, page_url, read_assets
from stage_runtime.serve.app import build_app
from stage_runtime.serve.metrics import StageMetrics
from stage_runtime.serve.service import StageService

SHIPPED = sorted(path.name for path in STATIC.iterdir())


def stage_app(playground: bool = True, keys: tuple[bytes, ...] = ()):
    config = load_config({"model": {"path": "/m"}, "server": {"playground": playground}})
    return build_app(StageService(config, StageMetrics()), keys)


def test_the_policy_allows_this_origin_only_and_no_inline_script():
    rules = dict(rule.split(" ", 1) for rule in CSP.split("; "))
    assert rules["default-src"] == "'none'" and rules["script-src"] == "'self'" and rules["style-src"] == "'self'"
    assert rules["connect-src"] == "'self'" and rules["frame-ancestors"] == "'none'" and rules["base-uri"] == "'none'"
    assert "unsafe" not in CSP and "http" not in CSP


async def test_the_page_and_every_asset_carry_the_strict_headers_on_a_keyed_stage():
    async with TestClient(TestServer(stage_app(keys=(b"sk",)))) as client:
        for path in ("/", "/playground", *(ASSET_PREFIX + name for name in SHIPPED if name != "index.html")):
            answer = await client.get(path)
            assert answer.status == 200, path                               # open: no key needed for the page
            assert answer.headers["Content-Security-Policy"] == CSP
            assert answer.headers["X-Content-Type-Options"] == "nosniff"
            assert answer.headers["X-Frame-Options"] == "DENY"
        assert (await client.get("/")).content_type == "text/html"
        assert (await client.get(ASSET_PREFIX + "app.js")).content_type == "text/javascript"
        assert (await client.get("/v1/models")).status == 401                # the API it calls is keyed


async def test_an_asset_not_shipped_is_a_404_naming_it():
    async with TestClient(TestServer(stage_app())) as client:
        for name in ("nope.js", "..%2Fstatic%2Fapp.js", "index.html", "route.py"):
            answer = await client.get(ASSET_PREFIX + name)
            assert answer.status == 404, name
            assert (await answer.json())["error"]["type"] == "not_found"


async def test_no_playground_leaves_the_routes_out():
    async with TestClient(TestServer(stage_app(playground=False))) as client:
        for path in ("/", "/playground", ASSET_PREFIX + "app.js"):
            assert (await client.get(path)).status == 404, path
    args = build_parser().parse_args(["serve", "--model", "/m", "--no-playground"])
    assert config_from_args(args).server.playground is False
    assert config_from_args(build_parser().parse_args(["serve", "--model", "/m"])).server.playground is True


@pytest.mark.parametrize("name", SHIPPED)
def test_a_shipped_file_names_nothing_outside_the_stage(name):
    text = (STATIC / name).read_text()
    assert not re.search(r"(?i)\b(?:https?:|wss?:|ftp:)//|(?<![\w.])//[\w-]+\.[\w.-]+", text), name
    assert "eval(" not in text and "new Function" not in text and "innerHTML" not in text, name
    assert "document.write" not in text and "insertAdjacentHTML" not in text, name


def test_the_page_has_no_inline_script_style_or_handler_and_loads_only_shipped_files():
    page, assets = read_assets()
    html = page.decode()
    assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", html)            # every script is a file
    assert not re.search(r"\son\w+\s*=", html) and "<style" not in html and " style=" not in html
    referenced = set(re.findall(r'(?:src|href)="/playground/assets/([^"]+)"', html))
    imported = {m for text in assets.values() for m in re.findall(rb'from "\./([^"]+)"', text[0])}
    assert referenced | {m.decode() for m in imported} <= set(assets)        # nothing names a file not shipped
    assert set(assets) == set(SHIPPED) - {"index.html"}                       # and nothing ships unserved


def test_the_printed_url_reaches_the_page_from_this_machine():
    assert page_url("0.0.0.0", 8000) == "http://localhost:8000/"
    assert page_url("127.0.0.1", 9) == "http://127.0.0.1:9/"
    assert page_url("::1", 80) == "http://[::1]:80/"
