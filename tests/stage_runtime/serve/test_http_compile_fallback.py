"""A compile that fails, or runs past its bound, never crash-loops and is never silent: the stage becomes ready,
serves eagerly, and ``/v1/stats`` (``mode_effective: none`` with the reason) and ``/metrics``
(``diffstage_compile_fallback 1``) say why; each of those stages compiles into an empty folder, so nothing comes
from a cache. A stage at its ``max_graphs`` keeps its graphs and runs what would need another one eagerly. A stage whose warm-up
died mid-compile (killed here; a segfault in generated code in the wild) is not followed by another crash: the next
process on the same cache folder serves eagerly and says why."""

from __future__ import annotations

import httpx
import pytest
from serve_probes import decode_png, metric_samples
from stage_process import StageProcess, running_stage
from support.compile_cache import shared_compile_cache
from support.waiting import wait_until

STAGE = ["--model", "tiny-digits", "--device", "cpu", "--compile", "regional"]


@pytest.mark.parametrize("case", ["no-compiler", "timeout"])
def test_a_failed_compile_falls_back_to_eager_and_says_why(case, tmp_path, monkeypatch):
    args = [*STAGE, "--compile-cache-dir", str(tmp_path / "cache")]
    if case == "no-compiler":
        monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))          # inductor's C++ compiler is gone
        expected = "No working C++ compiler"
    else:
        args += ["--compile-timeout-s", "0.001"]          # over before the first graph's compile starts
        expected = "the warm-up compile ran past compile.timeout_s=0.001"
    with running_stage(args, tmp_path / "stage.log", ready_timeout=300) as stage:
        with httpx.Client(base_url=stage.http_url, timeout=120) as http:
            view = http.get("/v1/stats").json()["compile"]
            assert view["mode"] == "regional" and view["mode_effective"] == "none", view
            assert expected in view["reason"] and view["graphs"] == 0, view
            resp = http.post("/v1/images/generations", json={"prompt": "3", "seed": 1, "num_inference_steps": 4})
            assert resp.status_code == 200 and decode_png(resp.json()["data"][0]["b64_json"]).shape == (32, 32, 3)
            samples = metric_samples(http.get("/metrics").text)
        assert samples[("diffstage_compile_fallback", (("rank", "0"),))] == 1
        assert "compile: falling back to eager" in stage.log


def test_past_max_graphs_new_shapes_run_eagerly_never_a_recompile(tmp_path):
    args = [*STAGE, "--compile-cache-dir", str(shared_compile_cache()), "--compile-max-graphs", "1",
            "--max-num-seqs", "4"]
    with running_stage(args, tmp_path / "stage.log", ready_timeout=300) as stage:
        with httpx.Client(base_url=stage.http_url, timeout=120) as http:
            for n, guidance in ((1, 1.0), (3, 4.0)):       # 1 row, then 6: layouts and batches the one graph lacks
                body = {"prompt": "5", "seed": n, "n": n, "guidance_scale": guidance, "num_inference_steps": 3}
                assert http.post("/v1/images/generations", json=body).status_code == 200
            view = http.get("/v1/stats").json()["compile"]
        assert view["mode_effective"] == "regional" and view["graph_limit_reached"], view
        assert (view["graphs"], view["recompiles"]) == (1, 0), view
        assert "max_graphs=1 reached" in stage.log


def test_after_a_warm_up_that_died_the_next_process_serves_eagerly(tmp_path):
    cache = tmp_path / "cache"
    args = [*STAGE, "--compile-cache-dir", str(cache)]
    dying = StageProcess(args, tmp_path / "dying.log")
    try:
        dying.start(wait_ready=False)
        markers = wait_until(lambda: list(cache.glob("diffstage-warmups/*.pending")), timeout=120,
                             what="the warm-up's marker")
        dying.kill()                                          # SIGKILL mid-compile: nothing of it can clean up
    finally:
        dying.kill()
    assert all(m.exists() for m in markers)
    with running_stage(args, tmp_path / "next.log", ready_timeout=300) as stage:
        with httpx.Client(base_url=stage.http_url, timeout=120) as http:
            view = http.get("/v1/stats").json()["compile"]
            assert http.post("/v1/images/generations", json={"prompt": "2", "num_inference_steps": 3}).status_code == 200
    assert view["mode_effective"] == "none" and view["graphs"] == 0, view
    assert "a previous warm-up of this model compiling regional died with its process" in view["reason"], view
