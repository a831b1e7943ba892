"""The compiled denoiser as the stage reports it: ``/v1/stats.compile`` (one view over every rank) and its metrics.

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

from prometheus_client import CollectorRegistry, Counter, Gauge


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
