"""The step watchdog in a real stage process: a request whose step makes no progress takes the replica out of
rotation (/ready 503 "stalled", new work 503) until the step moves again; one that never moves makes the stage
fail closed (exit 3, StepStalled in the termination log), leaving no process and no /dev/shm segment."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from serve_probes import MP_CFG2, UNI, decode_png, wait_until
from stage_process import StageProcess

HANG = "adapters_for_tests:HangUntilFileSDAdapter"
UNREADY_S, FAIL_S = 1, 8


async def _ready_state(http: httpx.AsyncClient) -> tuple[int, dict]:
    answer = await http.get("/ready")
    return answer.status_code, answer.json()


@pytest.mark.parametrize("topology", [MP_CFG2, UNI], ids=["mp-cfg2", "uni"])   # a stuck rank, a stuck thread
async def test_a_stalled_step_fences_the_replica_until_it_moves_and_fails_closed_when_it_never_does(
        tmp_path, tiny_sd_path, topology):
    config = tmp_path / "stage.yaml"          # the fault-injecting adapter through the registry override
    config.write_text(json.dumps({"model": {"path": tiny_sd_path, "adapter": HANG}}))
    stage = StageProcess(["--config", str(config), *topology, "--max-num-seqs", "1",
                          "--stall-unready-s", str(UNREADY_S), "--stall-fail-s", str(FAIL_S)],
                         tmp_path / "stage.log", tmp_path / "termination")
    try:
        stage.start()
        release = tmp_path / "release"
        async with httpx.AsyncClient(base_url=stage.http_url, timeout=60) as http:
            # 1. stalls, is fenced, moves again: back in rotation, the request answers
            stuck = asyncio.create_task(http.post("/v1/images/generations", json={
                "prompt": f"hang:{release}", "num_inference_steps": 2, "request_id": "stuck"}))
            status, body = await wait_until(lambda: _stalled(http), what="/ready 503 stalled")
            assert body["state"] == "stalled"         # the adapter hangs before its first step: in the encode phase
            assert "requests stuck, encoding the prompt, before step 1" in body["error"]["message"]
            assert (await http.get("/health")).status_code == 200             # alive: not restarted for this
            refused = await http.post("/v1/images/generations", json={"prompt": "x", "num_inference_steps": 1})
            assert refused.status_code == 503 and "stalled" in refused.json()["error"]["message"]
            release.touch()
            answer = await stuck
            assert answer.status_code == 200, answer.text
            assert decode_png(answer.json()["data"][0]["b64_json"]).shape == (64, 64, 3)
            assert (await _ready_state(http))[0] == 200

            # 2. never moves: past stall_fail_s the stage fails closed, the request gets engine_dead
            stage.track()
            doomed = await http.post("/v1/images/generations", json={
                "prompt": f"hang:{tmp_path / 'never'}", "num_inference_steps": 2, "request_id": "doomed"})
            assert doomed.status_code == 503, doomed.text
            error = doomed.json()["error"]
            assert error["type"] == "engine_dead" and "no step progress for" in error["message"]
        assert stage.wait(30) == 3, stage.log[-3000:]
        message = stage.termination_log.read_text()
        assert message.startswith("StepStalled: step stalled: no step progress for ") and message.count("\n") == 1
        assert "requests doomed, encoding the prompt, before step 1" in message and f"stall_fail_s={FAIL_S}" in message
        stage.assert_no_leaks()
    finally:
        stage.kill()


async def _stalled(http: httpx.AsyncClient):
    status, body = await _ready_state(http)
    return (status, body) if status == 503 and body.get("state") == "stalled" else None
