"""The stage's startup as the operator sees it: `/ready` 503 with `state: loading` and the phase
(loading weights, then warmup), `/v1/stats.startup` with each phase's duration once ready, and a startup
budget (`--startup-timeout`) whose expiry ends the process with `StartupTimeout` naming the phase."""

from __future__ import annotations

import time

import httpx
from stage_process import StageProcess


def _ready_body(url: str) -> tuple[int, dict]:
    try:
        response = httpx.get(f"{url}/ready", timeout=5)
    except httpx.HTTPError:
        return 0, {}
    return response.status_code, response.json()


def test_a_warmup_beyond_the_startup_budget_fails_with_a_reason_that_says_so(shared_stage, tiny_sd_path, tmp_path):
    # The budget counts from the process start, so it must hold the imports and the loading with room to spare
    # however busy the machine is: three times what loading took the shared stage in this session, at least
    # 20 s. The warmup (SlowWarmupExecutor) never ends within it.
    loaded = httpx.get(f"{shared_stage.http_url}/v1/stats", timeout=5).json()["startup"]["phases"]["loading_weights"]
    budget = max(20, int(3 * loaded) + 10)
    term = tmp_path / "termination.log"
    stage = StageProcess(["--model", tiny_sd_path, "--device", "cpu", "--executor",
                          "executors_for_tests:SlowWarmupExecutor", "--startup-timeout", str(budget)],
                         tmp_path / "stage.log", termination_log=term)
    started = time.monotonic()
    stage.start(wait_ready=False)
    try:
        stage.wait_listening(60)
        seen = []
        while stage.proc.poll() is None and time.monotonic() - started < budget + 30:
            status, body = _ready_body(stage.http_url)
            if status == 503 and body.get("state") == "loading" and body["phase"] not in seen[-1:]:
                seen.append(body["phase"])
                assert "the stage is loading: " in body["error"]["message"], body
            time.sleep(0.1)
        code = stage.wait(30)
        elapsed = time.monotonic() - started
    finally:
        stage.kill()
    assert seen[-2:] == ["loading_weights", "warmup"], seen
    assert code == 1, stage.log[-2000:]
    line = term.read_text().strip()
    assert line.startswith(f"StartupTimeout: not ready within the startup budget of {budget} s "
                           "(--startup-timeout, spec.startupTimeoutSeconds): warmup for "), line
    assert "loading weights took" in line, line
    assert budget <= elapsed < budget + 30, f"exited {elapsed:.1f} s after the start, at once past the budget"


def test_ready_stats_report_how_long_each_phase_took(stage):
    stats = httpx.get(f"{stage.http_url}/v1/stats", timeout=5).json()
    assert stats["state"] == "ready" and httpx.get(f"{stage.http_url}/ready", timeout=5).status_code == 200
    startup = stats["startup"]
    assert startup["phase"] is None and set(startup["phases"]) == {"loading_weights", "warmup"}, startup
    assert all(v > 0 for v in startup["phases"].values()) and startup["model_bytes"] > 100_000, startup
