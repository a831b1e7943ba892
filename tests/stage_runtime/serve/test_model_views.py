"""``/v1/stats.weights`` and ``/v1/stats.compile`` over the ranks (serve/model_views.py) and their metrics: a fallback on any rank is the
stage's, recompiles only grow the counter, the cache outcome of the ranks combines."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from serve_probes import metric_samples

from stage_runtime.serve.model_views import CompileMetrics, WeightMetrics, compile_view, weights_view


def rank(r: int, **over) -> dict:
    return {"rank": r, "mode": "regional", "mode_effective": "regional", "reason": None, "auto": None, "warm": True,
            "graphs": 4, "recompiles": 0, "graph_limit_reached": False, "cold_compile_s": 10.0 + r, "cache": "miss",
            "eager_calls": {"lora": 2}, **over}


def test_the_view_over_ranks():
    view = compile_view("regional", [rank(0), rank(1, graphs=5, cache="hit", eager_calls={"lora": 1})])
    assert (view["mode_effective"], view["graphs"], view["cold_compile_s"], view["cache"]) == ("regional", 5, 11.0,
                                                                                               "partial")
    assert view["eager_calls"] == {"lora": 3} and view["reason"] is None and len(view["ranks"]) == 2


def test_one_rank_that_fell_back_makes_the_stage_eager_with_its_reason():
    view = compile_view("regional", [rank(0), rank(1, mode_effective="none", reason="BasicTransformerBlock: boom")])
    assert view["mode_effective"] == "none" and view["reason"] == "BasicTransformerBlock: boom"


def test_before_the_first_report():
    assert compile_view("auto", None) == {"mode": "auto", "mode_effective": None, "reason": None, "warm": False,
                                          "ranks": []}


def test_the_metrics_follow_the_reports():
    registry = CollectorRegistry()
    metrics = CompileMetrics("diffstage_", registry)
    metrics.observe(compile_view("regional", [rank(0)]))
    metrics.observe(compile_view("regional", [rank(0, graphs=6, recompiles=2)]))
    metrics.observe(compile_view("regional", [rank(0, graphs=6, recompiles=2, reason="x", mode_effective="none")]))
    samples = metric_samples(generate_latest(registry).decode())
    assert samples[("diffstage_compile_graphs", (("rank", "0"),))] == 6
    assert samples[("diffstage_compile_recompiles_total", (("rank", "0"),))] == 2
    assert samples[("diffstage_compile_fallback", (("rank", "0"),))] == 1
    assert samples[("diffstage_compile_cold_seconds", (("rank", "0"),))] == 10.0


def test_the_weights_view_and_its_metrics():
    ranks = [{"rank": r, "method": "int8-weight", "bytes": 130 + r, "components": {
        "transformer": {"bytes": 100, "bytes_as_loaded": 400, "method": "int8-weight", "layers_quantized": 9},
        "vae": {"bytes": 30 + r, "method": "none"}}} for r in (0, 1)]
    view = weights_view(ranks)
    assert (view["method"], view["bytes"], view["rank_bytes"]) == ("int8-weight", 130, [130, 131])
    registry = CollectorRegistry()
    WeightMetrics("diffstage_", registry).observe(view)
    samples = metric_samples(generate_latest(registry).decode())
    assert samples[("diffstage_weight_bytes", (("component", "transformer"),))] == 100
    assert samples[("diffstage_weight_bytes", (("component", "vae"),))] == 30
    assert samples[("diffstage_weight_bytes_as_loaded", (("component", "transformer"),))] == 400
    assert ("diffstage_weight_bytes_as_loaded", (("component", "vae"),)) not in samples
