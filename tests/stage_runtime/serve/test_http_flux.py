"""A FLUX.1 stage process in step mode over HTTP: two SSE streams of different step counts batched, progress
in order, final images equal to the bare FluxPipeline call; a negative prompt refused at admission (400 naming
it, over HTTP and through the OpenAI SDK, no retry; every family's refusals: tests/stage_runtime/engine/
test_admission.py). (The sample's topology — 2 rank processes,
Ulysses 2 — runs end to end in e2e/local/test_local_cluster_flux.py; CFG-parallel is refused in
tests/stage_runtime/models/test_flux.py.)"""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from engine_probes import phased
from serve_probes import assert_refused_at_admission, decode_png, sse_events
from stage_process import running_stage

UNI = ["--device", "cpu", "--executor", "uni"]


@pytest.fixture(scope="module")
def flux_stage(tiny_flux_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("flux-stage")
    with running_stage(["--model", tiny_flux_path, "--execution-mode", "step", "--max-num-seqs", "4", *UNI],
                       logs / "stage.log") as stage:
        yield stage


def bare_call(path: str, prompt: str, steps: int, seed: int) -> np.ndarray:
    pipe = DiffusionPipeline.from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    image = pipe(prompt, height=64, width=64, num_inference_steps=steps, guidance_scale=3.5, output_type="np",
                 generator=torch.Generator().manual_seed(seed)).images[0]
    return (image * 255).round().clip(0, 255).astype(np.uint8)


async def test_two_sse_streams_batched_progress_in_order_images_equal_the_bare_call(flux_stage, tiny_flux_path):
    async def stream(http, rid: str, prompt: str, steps: int, seed: int) -> list[tuple[str, dict]]:
        body = {"prompt": prompt, "num_inference_steps": steps, "seed": seed, "stream": True, "request_id": rid,
                "size": "64x64", "stream_format": "diffstage"}     # our event names (the default is OpenAI's)
        async with http.stream("POST", "/v1/images/generations", json=body) as resp:
            assert resp.status_code == 200
            return sse_events((await resp.aread()).decode())

    async with httpx.AsyncClient(base_url=flux_stage.http_url, timeout=120) as http:
        a, b = await asyncio.gather(stream(http, "flux-a", "a photo of a cat", 5, 3),
                                    stream(http, "flux-b", "a red car", 3, 4))
        stats = (await http.get("/v1/stats")).json()
    assert stats["finished_total"] == 2 and stats["running"] == 0
    for events, steps in ((a, 5), (b, 3)):
        assert [(d["phase"], d["step"]) for kind, d in events if kind == "progress"] == phased(steps)
        assert [kind for kind, _ in events].count("completed") == 1 and events[-1][0] == "completed"
    got_a, got_b = (decode_png(ev[-1][1]["data"][0]["b64_json"]) for ev in (a, b))
    for got, (prompt, steps, seed) in ((got_a, ("a photo of a cat", 5, 3)), (got_b, ("a red car", 3, 4))):
        ref = bare_call(tiny_flux_path, prompt, steps, seed)
        assert got.std() > 10 and np.abs(got.astype(int) - ref.astype(int)).max() <= 2



def test_a_negative_prompt_is_a_400_naming_it_at_admission_never_a_500_the_sdk_retries(flux_stage):
    assert_refused_at_admission(flux_stage.http_url, {"prompt": "a cat", "negative_prompt": "blurry", "size": "64x64",
                                                      "num_inference_steps": 2}, "negative_prompt", "'blurry'")
