"""The stage as OpenAI clients use it: the official ``openai`` SDK against one real stage process (step mode,
API keys on): models, generations (b64, n=2, png/jpeg/webp), edits with and without a mask, SDK-parsed
streaming with partial images, API keys, and the upload limits (413/400) at the edge."""

from __future__ import annotations

import base64
import io
import time

import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from engine_probes import phased
from serve_probes import metric_samples
from stage_process import running_stage

KEY = "sk-test-0123456789"
STEPS = {"num_inference_steps": 4}
LIMITS = ["--max-upload-bytes", str(64 * 1024), "--max-image-pixels", str(128 * 128)]


@pytest.fixture(scope="module")
def sdk_stage(tiny_sd_path, tmp_path_factory):
    """One stage for every test of this module: step mode, 2 running, API keys from a file."""
    tmp = tmp_path_factory.mktemp("sdk-stage")
    (tmp / "keys").write_text(f"# keys\n{KEY}\nsk-other\n")
    with running_stage(["--model", tiny_sd_path, "--served-name", "tiny-sd", "--device", "cpu", "--executor", "uni",
                        "--execution-mode", "step", "--max-num-seqs", "2", "--max-waiting", "4",
                        "--api-key-file", str(tmp / "keys"), *LIMITS], tmp / "stage.log") as stage:
        yield stage


@pytest.fixture
def client(sdk_stage):
    with openai.OpenAI(base_url=f"{sdk_stage.http_url}/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def png(array: np.ndarray, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array, mode).save(buf, format="PNG")
    return buf.getvalue()


def picture(side: int = 64, seed: int = 0) -> np.ndarray:
    y, x = np.mgrid[0:side, 0:side] / side
    return ((np.stack([np.sin(6 * x + seed), np.cos(5 * y), x * y], -1) + 1) * 127).astype(np.uint8)


def decoded(b64: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    image.load()
    return image


def test_models_list_and_retrieve_carry_the_family_facts(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-sd"] and models[0].owned_by == "diffstage"
    facts = models[0].diffstage
    assert facts["pipeline_class"] == "StableDiffusionPipeline" and facts["parallel_kinds"] == ["cfg", "ulysses"]
    assert facts["guidance"] == "cfg" and facts["max_sequence_length"] == 77 and facts["supports_edits"]
    assert client.models.retrieve("tiny-sd").id == "tiny-sd"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-image-1")


@pytest.mark.parametrize("fmt,pil_format", [("png", "PNG"), ("jpeg", "JPEG"), ("webp", "WEBP")])
def test_generate_b64_n2_in_each_output_format(client, fmt, pil_format):
    extra = {**STEPS, "seed": 3, "output_format": fmt, "quality": "standard", "style": "vivid", "moderation": "auto"}
    if fmt != "png":
        extra["output_compression"] = 80
    result = client.images.generate(prompt="a red fox", n=2, size="64x48", response_format="b64_json", user="u-1",
                                    extra_body=extra)
    assert len(result.data) == 2 and result.output_format == fmt and result.size == "64x48"
    for item in result.data:
        image = decoded(item.b64_json)
        assert image.format == pil_format and image.size == (64, 48)


def test_openai_fields_with_no_meaning_here_are_refused_by_name(client):
    with pytest.raises(openai.BadRequestError, match="background"):
        client.images.generate(prompt="x", background="transparent", extra_body=STEPS)
    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(prompt="x", extra_body={"not_an_openai_field": 1})
    assert err.value.body["param"] == "not_an_openai_field"
    with pytest.raises(openai.BadRequestError, match="output_compression"):
        client.images.generate(prompt="x", output_compression=50, extra_body=STEPS)


def test_a_request_over_the_cost_bound_is_a_400_naming_the_size_counted_invalid(client, sdk_stage):
    """Tiny SD is native 64x64: the default bound is 1000 steps of one 64x64 output; 128x128 x 300 is over."""
    invalid, failed = (("diffstage_requests_total", (("outcome", outcome),)) for outcome in ("invalid", "failed"))
    before = metric_samples(httpx.get(f"{sdk_stage.http_url}/metrics").text)
    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(prompt="x", size="128x128", extra_body={"num_inference_steps": 300})
    assert err.value.status_code == 400 and err.value.body["param"] == "size"
    assert "= 4,915,200 pixel-steps is over this stage's limit of 4,096,000" in err.value.body["message"]
    after = metric_samples(httpx.get(f"{sdk_stage.http_url}/metrics").text)
    assert after[invalid] == before[invalid] + 1 and after[failed] == before[failed]


@pytest.mark.parametrize("with_mask", [False, True])
def test_edit_with_and_without_mask(client, with_mask):
    mask = None
    if with_mask:
        alpha = np.full((64, 64), 255, np.uint8)
        alpha[16:48, 16:48] = 0                                      # OpenAI: transparent = repaint
        mask = ("mask.png", png(np.dstack([picture(), alpha]), "RGBA"), "image/png")
    kwargs = {"mask": mask} if mask else {}
    results = [client.images.edit(image=("in.png", png(picture()), "image/png"), prompt="a cat", size="auto",
                                  extra_body={**STEPS, "seed": 5, "strength": 0.75}, **kwargs) for _ in range(2)]
    images = [np.asarray(decoded(r.data[0].b64_json)) for r in results]
    assert images[0].shape == (64, 64, 3)
    assert np.array_equal(images[0], images[1])                      # same seed, same image


def test_stream_with_partial_images_yields_the_sdk_events(client):
    events = list(client.images.generate(prompt="a red fox", stream=True, partial_images=2,
                                         extra_body={"num_inference_steps": 6, "seed": 1}))
    kinds = [e.type for e in events]
    partials = [e for e in events if e.type == "image_generation.partial_image"]
    completed = [e for e in events if e.type == "image_generation.completed"]
    assert [p.partial_image_index for p in partials] == [0, 1]
    assert len(completed) == 1 and kinds[-1] == "image_generation.completed"
    assert isinstance(completed[0], openai.types.ImageGenCompletedEvent)
    assert decoded(completed[0].b64_json).size == (64, 64) and completed[0].size == "64x64"
    progress = [e for e in events if e.type == "image_generation.progress"]     # the extra event: encode, one per
    assert [(e.phase, e.step) for e in progress] == phased(6)                   # step but the last, decode


def test_edit_stream_yields_edit_events(client):
    events = list(client.images.edit(image=("in.png", png(picture()), "image/png"), prompt="a cat", stream=True,
                                     partial_images=1, extra_body={**STEPS, "seed": 2, "strength": 1.0}))
    kinds = [e.type for e in events]
    assert kinds.count("image_edit.partial_image") == 1 and kinds[-1] == "image_edit.completed"


def test_api_keys_guard_v1_and_leave_probes_open(sdk_stage):
    with openai.OpenAI(base_url=f"{sdk_stage.http_url}/v1", api_key="sk-wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    with httpx.Client(base_url=sdk_stage.http_url, timeout=10) as http:
        missing = http.get("/v1/stats")
        assert missing.status_code == 401 and missing.json()["error"]["type"] == "unauthorized"
        assert missing.headers["WWW-Authenticate"] == "Bearer"
        assert http.get("/v1/stats", headers={"Authorization": "Bearer sk-other"}).status_code == 200
        for path in ("/health", "/ready", "/metrics", "/openapi.json"):
            assert http.get(path).status_code == 200, path


@pytest.mark.parametrize("case,status,param", [
    ("undecodable", 400, "image"), ("mask_mismatch", 400, "mask"), ("too_many_pixels", 413, "image"),
    ("too_many_bytes", 413, "body"), ("no_image", 400, "image"), ("two_images", 400, "image[1]"),
])
def test_upload_errors_at_the_edge(sdk_stage, case, status, param):
    files: list = [("image", ("in.png", png(picture()), "image/png"))]
    if case == "undecodable":
        files = [("image", ("in.png", b"\x89PNG not really", "image/png"))]
    elif case == "mask_mismatch":
        files.append(("mask", ("m.png", png(np.zeros((32, 32), np.uint8), "L"), "image/png")))
    elif case == "too_many_pixels":
        files = [("image", ("big.png", png(np.zeros((200, 200, 3), np.uint8)), "image/png"))]
    elif case == "too_many_bytes":
        files = [("image", ("padded.png", png(picture()) + b"\0" * (70 * 1024), "image/png"))]   # over 64 KiB
    elif case == "no_image":
        files = [("mask", ("m.png", png(np.zeros((64, 64), np.uint8), "L"), "image/png"))]
    elif case == "two_images":
        files = [("image[]", ("a.png", png(picture()), "image/png")), ("image[]", ("b.png", png(picture()), "image/png"))]
    data = {"prompt": "a cat"}
    with httpx.Client(base_url=sdk_stage.http_url, timeout=30, headers={"Authorization": f"Bearer {KEY}"}) as http:
        answer = http.post("/v1/images/edits", data=data, files=files)
        assert answer.status_code == status, answer.text[:300]
        assert answer.json()["error"]["param"] == param
        assert http.get("/v1/requests").json()["requests"] == []     # nothing admitted, nothing lost


FUZZ_CASES = 240
FUZZ_BUDGET_S = 420.0


def bounded_cost(case) -> None:
    """Keep a valid generation cheap (few steps, few images): the fuzz is about the edge, not the UNet."""
    if isinstance(case.body, dict):
        for field, most in (("num_inference_steps", 2), ("n", 2), ("partial_images", 1)):
            value = case.body.get(field)
            if isinstance(value, int) and not isinstance(value, bool) and value > most:
                case.body[field] = most


def own_deadline(case, response) -> bool:
    """A 504 deadline_exceeded for a case that set its own (tiny) ``timeout_s``: the documented answer, no fault."""
    body = case.body if isinstance(case.body, dict) else {}
    return (response.status_code == 504 and body.get("timeout_s") is not None
            and '"deadline_exceeded"' in response.text)


def test_schemathesis_over_openapi_json_finds_no_5xx(sdk_stage):
    """Seeded (derandomized), bounded (cases and seconds) fuzzing of every route from /openapi.json."""
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{sdk_stage.http_url}/openapi.json")
    strategy = st.one_of(schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE))
    auth = {"Authorization": f"Bearer {KEY}"}
    seen: list[tuple[str, int]] = []
    deadline = time.monotonic() + FUZZ_BUDGET_S

    @settings(max_examples=FUZZ_CASES, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def fuzz(case):
        if time.monotonic() > deadline:
            return
        bounded_cost(case)
        try:
            response = case.call(base_url=sdk_stage.http_url, headers=auth, timeout=20)
        except requests.exceptions.Timeout:
            seen.append((case.operation.label, 0))
            return
        seen.append((case.operation.label, response.status_code))
        if own_deadline(case, response):
            return
        assert response.status_code < 500, (case.operation.label, response.status_code, response.text[:500])

    started = time.monotonic()
    fuzz()
    statuses = sorted({status for _, status in seen})
    print(f"schemathesis: {len(seen)} cases over {len({label for label, _ in seen})} operations in "
          f"{time.monotonic() - started:.0f} s; statuses {statuses}")
    assert len(seen) >= 200, f"only {len(seen)} cases ran within {FUZZ_BUDGET_S} s"
    assert len({label for label, _ in seen}) >= 8                   # every route was reached
    with httpx.Client(base_url=sdk_stage.http_url, timeout=10) as http:
        assert http.get("/health").status_code == 200               # no crash
