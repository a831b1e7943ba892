"""The OpenAI-facing edge, pure (no process): field rules, image decoding, API keys, the OpenAPI document."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from stage_runtime.config import load_config
from stage_runtime.errors import ConfigError, InvalidRequestError, RequestTooLargeError
from stage_runtime.imageio import decode_image, decode_mask, encode_image
from stage_runtime.request import EditInput
from stage_runtime.serve.app import build_app
from stage_runtime.serve.auth import key_matches, load_api_keys
from stage_runtime.serve.metrics import StageMetrics
from stage_runtime.serve.openapi import openapi_document
from stage_runtime.serve.schemas import ImageEditRequest, ImageGenerationRequest, parse_body
from stage_runtime.serve.service import StageService


def gen(**body):
    return parse_body(ImageGenerationRequest, {"prompt": "x", **body})


@pytest.mark.parametrize("body,field", [
    ({"background": "transparent"}, "background"),
    ({"output_compression": 50}, "output_compression"),               # png has no quality
    ({"partial_images": 2}, "partial_images"),                         # needs stream
    ({"size": "auto"}, "size"),                                        # auto is for edits
    ({"size": "4096x4096"}, "size"),                                   # over max_image_pixels below
])
def test_cross_field_rules_name_the_field(body, field):
    with pytest.raises(InvalidRequestError) as err:
        gen(**body).to_request(max_pixels=1024 * 1024)
    assert err.value.field == field


@pytest.mark.parametrize("body,field", [
    ({"output_format": "gif"}, "output_format"), ({"partial_images": 4}, "partial_images"),
    ({"response_format": "url"}, "response_format"), ({"quality": "ultra"}, "quality"),
    ({"stream_format": "v2"}, "stream_format"), ({"style": "bold"}, "style"),
])
def test_values_openai_does_not_have_are_refused(body, field):
    with pytest.raises(InvalidRequestError) as err:
        gen(**body)
    assert err.value.field == field


def test_openai_fields_are_accepted_and_partial_images_reach_sampling():
    req = gen(quality="hd", style="natural", background="opaque", moderation="low", user="u", safety_identifier="s",
              output_format="webp", output_compression=70, stream=True, partial_images=3).to_request()
    assert req.sampling.partial_images == 3 and req.sampling.stream


def test_edit_form_fields_are_lax_strings_and_strict_about_unknown_names():
    body = parse_body(ImageEditRequest, {"prompt": "x", "n": "2", "strength": "0.5", "stream": "true"})
    assert (body.n, body.strength, body.stream, body.size) == (2, 0.5, True, "auto")
    with pytest.raises(InvalidRequestError) as err:
        parse_body(ImageEditRequest, {"prompt": "x", "styleee": "1"})
    assert err.value.field == "styleee"
    with pytest.raises(InvalidRequestError) as err:
        parse_body(ImageEditRequest, {"prompt": "x", "strength": "0"})
    assert err.value.field == "strength"


def _png(array, mode):
    buf = io.BytesIO()
    Image.fromarray(array, mode).save(buf, format="PNG")
    return buf.getvalue()


def test_masks_follow_openai_alpha_or_diffusers_white():
    alpha = np.full((8, 8), 255, np.uint8)
    alpha[:4] = 0
    rgba = np.dstack([np.zeros((8, 8, 3), np.uint8), alpha])
    assert (decode_mask(_png(rgba, "RGBA"), "mask", 1000)[:4] == 255).all()      # transparent = repaint
    assert (decode_mask(_png(rgba, "RGBA"), "mask", 1000)[4:] == 0).all()
    grey = np.zeros((8, 8), np.uint8)
    grey[2:4] = 255
    assert np.array_equal(decode_mask(_png(grey, "L"), "mask", 1000), grey)      # white = repaint


def test_decoding_bounds_pixels_and_names_the_field():
    image = np.arange(8 * 8 * 3, dtype=np.uint8).reshape(8, 8, 3)
    assert np.array_equal(decode_image(_png(image, "RGB"), "image", 64), image)
    with pytest.raises(RequestTooLargeError, match="image: 8x8 = 64 pixels"):
        decode_image(_png(image, "RGB"), "image", 63)
    with pytest.raises(InvalidRequestError) as err:
        decode_image(b"GIF89a nope", "image[0]", 64)
    assert err.value.field == "image[0]"


@pytest.mark.parametrize("fmt", ["png", "jpeg", "webp"])
def test_encodings_round_trip_at_the_right_size(fmt):
    image = np.full((16, 24, 3), 120, np.uint8)
    decoded = Image.open(io.BytesIO(encode_image(image, fmt, None if fmt == "png" else 90)))
    assert decoded.format == fmt.upper() and decoded.size == (24, 16)


def test_edit_task_comes_from_the_mask():
    image = np.zeros((8, 8, 3), np.uint8)
    assert EditInput(image).task == "img2img" and EditInput(image, np.zeros((8, 8), np.uint8)).task == "inpaint"
    assert EditInput(image, strength=0.55).denoise_steps(10) == 5


def test_api_key_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# comment\n\nsk-a\n  sk-b  \n")
    keys = load_api_keys(str(path))
    assert keys == (b"sk-a", b"sk-b")
    assert key_matches(b"sk-b", keys) and not key_matches(b"sk-c", keys) and not key_matches(b"", keys)
    path.write_text("# only a comment\n")
    with pytest.raises(ConfigError, match="no key"):
        load_api_keys(str(path))
    with pytest.raises(ConfigError, match="cannot read"):
        load_api_keys(str(tmp_path / "missing"))


def test_openapi_document_covers_every_route():
    service = StageService(load_config({"model": {"path": "/m"}}), StageMetrics())
    app = build_app(service, (b"k",))
    routes = {r.resource.canonical for r in app.router.routes()} - {"/openapi.json"}
    doc = openapi_document(api_keys=True)
    assert routes == set(doc["paths"])
    assert doc["paths"]["/v1/stats"]["get"]["security"] == [{"bearer": []}]
    assert "security" not in doc["paths"]["/health"]["get"]
    form = doc["components"]["schemas"]["ImageEditForm"]
    assert form["properties"]["image"]["format"] == "binary" and "strength" in form["properties"]


async def test_without_a_job_store_every_job_route_is_a_404_saying_how_to_turn_it_on():
    from aiohttp.test_utils import TestClient, TestServer

    service = StageService(load_config({"model": {"path": "/m"}}), StageMetrics())
    async with TestClient(TestServer(build_app(service))) as client:
        for method, path in (("POST", "/v1/videos"), ("GET", "/v1/videos"), ("GET", "/v1/videos/video_1"),
                             ("DELETE", "/v1/videos/video_1"), ("GET", "/v1/videos/video_1/content")):
            answer = await client.request(method, path)
            error = (await answer.json())["error"]
            assert answer.status == 404 and error["type"] == "jobs_not_configured", (method, path, error)
            assert "start it with --job-store DIR" in error["message"]
