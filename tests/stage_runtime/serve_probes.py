"""Helpers for driving a real stage over HTTP in tests (they observe; they replace nothing)."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import openai
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from support.waiting import async_wait_until as wait_until

UNI = ["--device", "cpu", "--executor", "uni"]                                     # every rank in the stage process
MP_CFG2 = ["--device", "cpu", "--executor", "mp", "--cfg-parallel-size", "2"]      # two gloo rank processes
LONG_STEPS = 999             # a request that runs until the test aborts it (~20 ms a step at 64 px)


def decode_png(b64: str) -> np.ndarray:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert image.format == "PNG"
    return np.asarray(image.convert("RGB"))


def sse_events(text: str) -> list[tuple[str, dict]]:
    events = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if line)
        events.append((fields["event"], json.loads(fields["data"])))
    return events


def metric_samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from a Prometheus exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def outcome_counts(http: httpx.Client) -> dict[str, float]:
    """``diffstage_requests_total`` by outcome, scraped from ``/metrics`` now."""
    samples = metric_samples(http.get("/metrics").text)
    return {dict(labels)["outcome"]: value for (name, labels), value in samples.items()
            if name == "diffstage_requests_total"}


def assert_refused_at_admission(base_url: str, body: dict, field: str, shown: str) -> None:
    """The generation ``body`` is refused at admission, once over plain HTTP and once through the official SDK
    (its default retries on): a 400 ``invalid_request_error`` whose ``param`` is ``field`` and whose message
    shows the value as ``shown``; the SDK sent exactly one request (a 400 is not retried, a 500 would be twice);
    the two count as outcome ``invalid``, none as ``failed``."""
    sent: list[httpx.Request] = []
    with (httpx.Client(base_url=base_url, timeout=60) as http,
          httpx.Client(timeout=60, event_hooks={"request": [sent.append]}) as sdk_http,
          openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", http_client=sdk_http) as client):
        before = outcome_counts(http)
        resp = http.post("/v1/images/generations", json=body)
        error = resp.json()["error"]
        assert resp.status_code == 400 and error["type"] == "invalid_request_error", resp.text
        assert error["param"] == field and error["message"].startswith(f"{field}={shown}: "), error
        try:
            client.images.generate(prompt=body["prompt"], extra_body={k: v for k, v in body.items() if k != "prompt"})
        except openai.BadRequestError as exc:
            refused = exc
        else:
            raise AssertionError(f"the SDK's request {body} was served")
        after = outcome_counts(http)
    assert [r.url.path for r in sent] == ["/v1/images/generations"], sent
    assert refused.status_code == 400 and refused.body["param"] == field
    assert refused.body["message"].startswith(f"{field}={shown}: "), refused.body
    assert (after["invalid"] - before["invalid"], after["failed"] - before["failed"]) == (2, 0), (before, after)


async def request_states(client: httpx.AsyncClient) -> dict[str, dict]:
    return {r["request_id"]: r for r in (await client.get("/v1/requests")).json()["requests"]}


async def wait_running(client: httpx.AsyncClient, request_id: str, min_step: int = 1) -> dict:
    async def running() -> bool:
        state = (await request_states(client)).get(request_id)
        return state is not None and state["state"] == "running" and state["step"] >= min_step

    await wait_until(running, what=f"{request_id} running")
    return (await request_states(client))[request_id]


async def wait_gone(client: httpx.AsyncClient, *request_ids: str, timeout: float = 10.0) -> None:
    async def gone() -> bool:
        return not set(request_ids) & set(await request_states(client))

    await wait_until(gone, timeout, what=f"{request_ids} gone")
