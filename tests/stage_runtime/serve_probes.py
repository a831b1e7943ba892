"""Helpers for driving a real stage over HTTP in tests (they observe; they replace nothing)."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
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
