"""What the stage's model holds and runs, as ``/v1/stats`` reports it over the ranks, and its metrics.

``/v1/stats.weights`` (``weights_view``): the weights per component (quantization.WeightReport).
``/v1/stats.compile`` (``compile_view``), the compiled denoiser:

    mode            what was asked (none | auto | regional | full)
    mode_effective  what runs: the mode auto resolved to; none when it resolved to eager or ANY rank fell back
    reason          the first rank's reason for falling back (a compile error, the warm-up past timeout_s), else None
    auto            which measurement auto followed (compilation.verdicts), with mode auto
    graphs          graphs compiled, the most of any rank (every rank compiles the same)
    recompiles      graphs compiled after warm-up, the most of any rank: 0 is the promise
    cold_compile_s  the warm-up's compile seconds, the longest rank's
    cache           hit (every graph from the cache folder) | miss | partial, over the ranks; None: nothing compiled
    eager_calls     calls run eagerly by reason (lora, block_cache), summed over the ranks
    ranks           each rank's own report (Compiler.stats)
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


def compile_view(mode: str, ranks: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    if not ranks:
        return {"mode": mode, "mode_effective": None, "reason": None, "warm": False, "ranks": []}
    effective = {r.get("mode_effective", "none") for r in ranks}
    caches = {r.get("cache") for r in ranks} - {None}
    eager = Tally()
    for r in ranks:
        eager.update(r.get("eager_calls") or {})
    return {"mode": mode, "mode_effective": "none" if "none" in effective else ranks[0]["mode_effective"],
            "reason": next((r["reason"] for r in ranks if r.get("reason")), None), "auto": ranks[0].get("auto"),
            "warm": all(r.get("warm") for r in ranks),
            "graphs": max(r.get("graphs", 0) for r in ranks), "recompiles": max(r.get("recompiles", 0) for r in ranks),
            "graph_limit_reached": any(r.get("graph_limit_reached") for r in ranks),
            "cold_compile_s": max(r.get("cold_compile_s", 0.0) for r in ranks),
            "cache": None if not caches else caches.pop() if len(caches) == 1 else "partial",
            "eager_calls": dict(eager), "ranks": [dict(r) for r in ranks]}


def weights_view(ranks: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``/v1/stats.weights``: rank 0's weights per component (bytes now, and as loaded when quantized), the method,
    and every rank's total (a tensor-parallel rank holds its shard)."""
    first = ranks[0]
    return {"method": first["method"], "components": first["components"], "bytes": first["bytes"],
            "rank_bytes": [r["bytes"] for r in ranks]}


class WeightMetrics:
    """``diffstage_weight_bytes{component}`` (rank 0's resident weights) and ``diffstage_weight_bytes_as_loaded``
    (before quantization), from ``/v1/stats.weights`` at scrape time."""

    def __init__(self, prefix: str, registry: CollectorRegistry):
        self.bytes = Gauge(f"{prefix}weight_bytes", "Bytes of the component's weights (rank 0), as stored: "
                           "quantized when quantization is on", ["component"], registry=registry)
        self.as_loaded = Gauge(f"{prefix}weight_bytes_as_loaded", "Bytes of the component's weights before "
                               "quantization (quantized components only)", ["component"], registry=registry)

    def observe(self, view: Mapping[str, Any] | None) -> None:
        for name, entry in ((view or {}).get("components") or {}).items():
            self.bytes.labels(name).set(entry["bytes"])
            if "bytes_as_loaded" in entry:
                self.as_loaded.labels(name).set(entry["bytes_as_loaded"])


class CompileMetrics:
    """``diffstage_compile_graphs{rank}``, ``diffstage_compile_recompiles_total{rank}``,
    ``diffstage_compile_fallback{rank}`` (1: serving eagerly after a failure) and
    ``diffstage_compile_cold_seconds{rank}``, refreshed from ``/v1/stats.compile`` at scrape time."""

    def __init__(self, prefix: str, registry: CollectorRegistry):
        self.graphs = Gauge(f"{prefix}compile_graphs", "Graphs the rank's compiled denoiser holds", ["rank"],
                            registry=registry)
        self.recompiles = Counter(f"{prefix}compile_recompiles", "Graphs compiled after warm-up (0 is the promise: "
                                  "a new shape past max_graphs runs eagerly instead)", ["rank"], registry=registry)
        self.fallback = Gauge(f"{prefix}compile_fallback", "1 when the rank serves eagerly because compiling "
                              "failed or ran past compile.timeout_s", ["rank"], registry=registry)
        self.cold_seconds = Gauge(f"{prefix}compile_cold_seconds", "Seconds the warm-up spent compiling",
                                  ["rank"], registry=registry)
        self._seen: dict[str, int] = {}

    def observe(self, view: Mapping[str, Any] | None) -> None:
        for r in (view or {}).get("ranks", []):
            rank = str(r.get("rank", 0))
            self.graphs.labels(rank).set(r.get("graphs", 0))
            new = int(r.get("recompiles", 0)) - self._seen.get(rank, 0)
            if new > 0:
                self.recompiles.labels(rank).inc(new)
                self._seen[rank] = int(r.get("recompiles", 0))
            else:
                self.recompiles.labels(rank)
            self.fallback.labels(rank).set(1 if r.get("reason") else 0)
            self.cold_seconds.labels(rank).set(r.get("cold_compile_s", 0.0))


class SleepMetrics:
    """``diffstage_sleeping`` (1 while asleep), ``diffstage_sleep_level`` (0 awake) from ``/v1/stats.sleep`` at
    scrape time, and ``diffstage_wake_seconds``, observed as each wake ends (engine.sleep_control's ``on_wake``)."""

    def __init__(self, prefix: str, registry: CollectorRegistry):
        self.sleeping = Gauge(f"{prefix}sleeping", "1 while the stage sleeps (sleep mode: its weights given back)",
                              registry=registry)
        self.level = Gauge(f"{prefix}sleep_level", "The sleep level (1: weights in host memory, 2: dropped); 0 awake",
                           registry=registry)
        self.wake_seconds = Histogram(f"{prefix}wake_seconds", "Seconds from a wake's start to every rank serving "
                                      "again", buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160),
                                      registry=registry)

    def observe(self, view: Mapping[str, Any] | None) -> None:
        if view is not None:
            self.sleeping.set(1 if view["is_sleeping"] else 0)
            self.level.set(view["level"] or 0)
