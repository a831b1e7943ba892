"""Edge validation of HTTP bodies (pure; no process): every problem names its field and value."""

from __future__ import annotations

import pytest

from stage_runtime.errors import InvalidRequestError
from stage_runtime.serve.schemas import AbortBody, ImageGenerationRequest, StageStats, error_body, parse_body


def parse(**body) -> ImageGenerationRequest:
    return parse_body(ImageGenerationRequest, body)


def test_openai_body_becomes_an_engine_request():
    gen = parse(prompt="a cat", n=3, size="96x48", seed=5, num_inference_steps=7, guidance_scale=3,
                negative_prompt="blur", request_id="r-1", model="tiny", user="u", stream=True, preview_every=2)
    req = gen.to_request()
    s = req.sampling
    assert req.request_id == "r-1" and req.prompt == "a cat"
    assert (s.width, s.height, s.num_outputs, s.seed, s.num_inference_steps) == (96, 48, 3, 5, 7)
    assert s.guidance_scale == 3.0 and s.negative_prompt == "blur" and s.stream and s.preview_every == 2


def test_defaults_leave_model_defaults_to_the_engine_and_assign_an_id():
    req = parse(prompt="a cat").to_request()
    assert req.request_id.startswith("img-")
    assert (req.sampling.width, req.sampling.height, req.sampling.num_inference_steps) == (None, None, None)
    assert req.sampling.num_outputs == 1 and not req.sampling.stream


@pytest.mark.parametrize("body,field,value", [
    ({"prompt": "x", "size": "64X64"}, "size", "64X64"),
    ({"prompt": "x", "size": "0x64"}, "size", "0x64"),
    ({"prompt": "x", "size": "60x64"}, "size", "60x64"),
    ({"prompt": "x", "n": True}, "n", True),                      # strict: a bool is not a count
    ({"prompt": "x", "n": 2.0}, "n", 2.0),
    ({"prompt": "x", "guidance_scale": "7"}, "guidance_scale", "7"),
    ({"prompt": "x", "stream": "yes"}, "stream", "yes"),
    ({"prompt": "x", "request_id": "has space"}, "request_id", "has space"),
    ({"prompt": "x", "extra": 1}, "extra", 1),
    ({"prompt": 5}, "prompt", 5),
    ({}, "prompt", None),
])
def test_bad_fields_name_the_field_and_value(body, field, value):
    with pytest.raises(InvalidRequestError) as info:
        parse_body(ImageGenerationRequest, body)
    assert info.value.field == field and info.value.value == value
    assert str(info.value).startswith(f"{field}={value!r}: ")


def test_integer_guidance_is_accepted_as_a_float():
    assert parse(prompt="x", guidance_scale=7).guidance_scale == 7.0


def test_preview_without_stream_is_refused():
    with pytest.raises(InvalidRequestError, match="preview_every=2: previews need stream=true"):
        parse(prompt="x", preview_every=2).to_request()


def test_body_must_be_an_object():
    with pytest.raises(InvalidRequestError, match="body='list'"):
        parse_body(ImageGenerationRequest, [])


def test_abort_body_takes_ids_or_all_but_not_both():
    assert parse_body(AbortBody, {"request_ids": ["a"]}).check().request_ids == ["a"]
    assert parse_body(AbortBody, {"all": True}).check().all
    with pytest.raises(InvalidRequestError, match="^all=True"):
        parse_body(AbortBody, {"all": True, "request_ids": []}).check()
    with pytest.raises(InvalidRequestError, match="^request_ids=None"):
        parse_body(AbortBody, {}).check()
    with pytest.raises(InvalidRequestError) as info:
        parse_body(AbortBody, {"request_ids": "a"})
    assert info.value.field == "request_ids"


def test_stats_shape_is_exactly_the_operator_contract():
    assert list(StageStats.model_fields) == ["state", "waiting", "running", "capacity", "finished_total",
                                             "aborted_total", "failed_total", "world_size", "topology", "workers",
                                             "startup", "cost", "offload", "compile", "weights", "jobs"]


def test_error_body():
    assert error_body("queue_full", "full") == {"error": {"type": "queue_full", "message": "full"}}
    assert error_body("invalid_request_error", "n=0: bad", "n")["error"]["param"] == "n"


def test_loras_name_adapters_and_scales_and_never_enter_a_compatibility_key():
    body = {"prompt": "a cat", "loras": [{"name": "pixel-art", "scale": 0.8}, {"name": "ink"}]}
    request = parse_body(ImageGenerationRequest, body).to_request()
    assert [(r.name, r.scale) for r in request.sampling.loras] == [("pixel-art", 0.8), ("ink", 1.0)]
    assert request.lora_key == (("pixel-art", 0.8, None), ("ink", 1.0, None))
    plain = parse_body(ImageGenerationRequest, {"prompt": "a cat"}).to_request()
    assert plain.lora_key == () and plain.batch_key == request.batch_key and plain.step_key == request.step_key
    hash(request.lora_key)


@pytest.mark.parametrize("loras, field", [
    ([{"name": "a", "path": "/etc/passwd"}], "loras.0.path"),          # names only, never paths
    ([{"name": "../a"}], "loras.0.name"),
    ([{"name": "a", "scale": 99}], "loras.0.scale"),
    ([{"name": "a"}, {"name": "a"}], "loras"),
    ([{"name": f"a{i}"} for i in range(9)], "loras"),
])
def test_bad_loras_name_the_field(loras, field):
    with pytest.raises(InvalidRequestError) as exc:
        parse_body(ImageGenerationRequest, {"prompt": "a cat", "loras": loras}).to_request()
    assert exc.value.field == field
