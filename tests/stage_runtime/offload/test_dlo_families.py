"""DLO beyond the UNet: Wan 2.2's two experts (each expert's head and blocks sharded, the wave's ranks on the same
expert at every step) and FLUX.2 [klein]'s double- then single-stream blocks. Two different requests in one wave, one
per rank, each equal to the same request on one rank without offload (request mode: within 1 uint8 per frame), and
every rank held half of each denoiser at rest."""

from __future__ import annotations

import pytest
from engine_probes import max_diff

from stage_runtime.config import load_config
from stage_runtime.engine.engine import DiffusionEngine
from stage_runtime.request import DiffusionRequest, SamplingParams

FAMILIES = {"wan22": ("tiny_wan22_path", {"height": 16, "width": 16, "num_frames": 9}, 3),   # 3 steps: both experts
            "flux2-klein": ("tiny_flux2_klein_path", {"height": 64, "width": 64}, 3)}


def make_request(rid: str, prompt: str, seed: int, fields: dict, steps: int) -> DiffusionRequest:
    return DiffusionRequest(rid, prompt, SamplingParams(num_inference_steps=steps, seed=seed, **fields),
                            video="num_frames" in fields)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_wave_of_two_requests_each_equal_to_one_rank(request, family):
    fixture, fields, steps = FAMILIES[family]
    path = request.getfixturevalue(fixture)
    asked = {"a": ("a red fox", 1), "b": ("a blue car", 2)}
    wave = [make_request(rid, prompt, seed, fields, steps) for rid, (prompt, seed) in asked.items()]
    plain = DiffusionEngine.make_engine(load_config({"model": {"path": path}, "device": "cpu", "executor": "uni",
                                                     "warmup": False}))
    try:
        expected = {r.request_id: plain.add_request(r).result(120).images for r in wave}
    finally:
        plain.close()
    dlo = DiffusionEngine.make_engine(load_config({
        "model": {"path": path}, "device": "cpu", "warmup": False, "parallel": {"num_gpus": 2},
        "offload": {"mode": "distributed"}, "scheduler": {"request_batch_max_wait_ms": 500}}))
    try:
        with dlo._lock:                                  # admitted together: one wave, one request per rank
            streams = [dlo.add_request(make_request(rid, prompt, seed, fields, steps))
                       for rid, (prompt, seed) in asked.items()]
        got = {s.request_id: s.result(120).images for s in streams}
        stats = dlo.collective_rpc("offload_stats")
    finally:
        dlo.close()
    for rid, images in got.items():
        assert max_diff(images, expected[rid]) <= 1, rid
    assert max_diff(got["a"], got["b"]) > 1, "the two ranks computed different requests"
    for s in stats:
        assert s["shard_bytes"] <= 0.55 * s["managed_bytes"] and s["gathers"] > 0, s
