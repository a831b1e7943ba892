"""Prometheus metrics of one stage process, on its own CollectorRegistry (never the global one).

Labels stay low-cardinality: an outcome, a worker rank, a stage state — never a request id or prompt.
Latencies come from the terminal output's timings; step time and batch size from the engine's execute
observer; waiting/running, worker liveness and state are read from ``/v1/stats`` at scrape time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from stage_runtime.jobs.record import STATUSES
from stage_runtime.serve.model_views import CompileMetrics, SleepMetrics, WeightMetrics
from stage_runtime.serve.fleet_metrics import FleetCollector

__all__ = ["CONTENT_TYPE_LATEST", "OUTCOMES", "StageMetrics"]

# completed / aborted / failed: the request ran; the others ended at admission or by the engine's death;
# deadline_exceeded: its timeout_s passed, queued (unrun) or running (stopped at the next step).
OUTCOMES = ("completed", "aborted", "failed", "dead", "invalid", "rejected", "unavailable", "deadline_exceeded")
STATES = ["starting", "ready", "draining", "dead"]
SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
FAST_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
BATCH = (1, 2, 4, 8, 16, 32, 64, 128)
PREFIX = "diffstage_"


class StageMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(f"{PREFIX}requests", "Requests by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)          # every outcome is exported from the start, at 0
        self.images = Counter(f"{PREFIX}images_generated", "Images returned by completed requests", registry=r)
        self.queue_seconds = Histogram(f"{PREFIX}request_queue_seconds", "Admission to first execution",
                                       buckets=SECONDS, registry=r)
        self.deadline_queue_seconds = Histogram(f"{PREFIX}request_deadline_queue_seconds", "Time in the queue "
                                                "of requests whose deadline passed there, unrun", buckets=SECONDS,
                                                registry=r)
        self.preemptions = Counter(f"{PREFIX}preemptions", "Step-boundary preemptions of finished requests",
                                   registry=r)
        self.cache_steps = Counter(f"{PREFIX}cache_steps", "Denoising steps of block-cached requests, computed or "
                                   "skipped (the rest of the blocks reused from the cache)", ["outcome"], registry=r)
        for outcome in ("computed", "skipped"):
            self.cache_steps.labels(outcome)
        self.result_cache_hits = Counter(f"{PREFIX}result_cache_hits", "Requests answered by the exact-hit result "
                                         "cache", registry=r)
        self.exec_seconds = Histogram(f"{PREFIX}request_exec_seconds", "First execution to the terminal output",
                                      buckets=SECONDS, registry=r)
        self.e2e_seconds = Histogram(f"{PREFIX}request_e2e_seconds", "Admission to the terminal output, by the "
                                     "outcome of requests that ran", ["outcome"], buckets=SECONDS, registry=r)
        self.step_seconds = Histogram(f"{PREFIX}denoise_step_seconds", "Wall time of one denoising step "
                                      "(one tick in step mode; wave time / steps in request mode)",
                                      buckets=FAST_SECONDS, registry=r)
        self.batch_size = Histogram(f"{PREFIX}batch_size", "Requests per executed wave or tick",
                                    buckets=BATCH, registry=r)
        self.waiting = Gauge(f"{PREFIX}requests_waiting", "Requests admitted and not yet running", registry=r)
        self.running = Gauge(f"{PREFIX}requests_running", "Requests running now", registry=r)
        self.capacity = Gauge(f"{PREFIX}requests_capacity", "Requests that can run at once (max_num_seqs)",
                              registry=r)
        self.jobs = Gauge(f"{PREFIX}video_jobs", "The model's video jobs in the shared store by status (as of "
                          "the replica's last scan; every replica sees the same store)", ["status"], registry=r)
        self.jobs_here = Gauge(f"{PREFIX}video_jobs_running_here", "Video jobs this replica runs now", registry=r)
        self.jobs_queued = Gauge(f"{PREFIX}jobs_queued", "The model's video jobs waiting for a replica, store-wide (the "
                                 "same on every replica: scale workers by it, do not sum it)", registry=r)
        self.worker_alive = Gauge(f"{PREFIX}worker_alive", "1 while the rank's worker is alive", ["rank"],
                                  registry=r)
        self.state = Enum(f"{PREFIX}stage_state", "Stage process state", states=STATES, registry=r)
        self.offload_resident = Gauge(f"{PREFIX}offload_resident_bytes", "Managed weight bytes per tier "
                                      "(offload on; the fast tier is what is materialised)", ["rank", "tier"],
                                      registry=r)
        self.offload_peak = Gauge(f"{PREFIX}offload_peak_resident_bytes", "Peak materialised managed bytes",
                                  ["rank"], registry=r)
        self.offload_transfers = Gauge(f"{PREFIX}offload_transfers", "Offload transfers since start, by kind "
                                       "(loads, releases, evictions, prefetches; DLO: gathers)", ["rank", "kind"],
                                       registry=r)
        self.offload_shard = Gauge(f"{PREFIX}offload_shard_bytes", "DLO: the denoiser bytes this rank holds at rest "
                                   "(its 1/dp shards)", ["rank"], registry=r)
        self.offload_gather = Gauge(f"{PREFIX}offload_gather_seconds", "DLO: seconds of all-gathers since start; "
                                    "kind wait is what the prefetch did not hide", ["rank", "kind"], registry=r)
        self.lora_resident = Gauge(f"{PREFIX}lora_adapters_resident", "LoRA adapters loaded now", registry=r)
        self.lora_requests = Gauge(f"{PREFIX}lora_requests", "Requests admitted with this LoRA adapter since start",
                                   ["adapter"], registry=r)
        self.lora_operations = Gauge(f"{PREFIX}lora_operations", "LoRA adapter operations since start, by kind "
                                     "(loads, unloads, evictions, refused)", ["kind"], registry=r)
        self.compile = CompileMetrics(PREFIX, r)
        self.weights = WeightMetrics(PREFIX, r)
        self.sleep = SleepMetrics(PREFIX, r)
        self.fleet = FleetCollector()      # utilisation, the LoRA gauge for the endpoint picker, the cost signal
        r.register(self.fleet)

    # -- observation ------------------------------------------------------------------------------------
    def observe_loras(self, snapshot: Mapping[str, Any], waiting: Sequence[str] = ()) -> None:
        """Scrape-time LoRA gauges from ``LoraTable.metrics()``; ``waiting``: the adapters waiting requests name."""
        if snapshot.get("serves_loras"):
            self.fleet.observe_loras(snapshot["names"], waiting, snapshot["max_loras"])
        self.lora_resident.set(snapshot["resident"])
        for adapter, n in snapshot["requests_by_adapter"].items():
            self.lora_requests.labels(adapter).set(n)
        for kind, n in snapshot["operations"].items():
            self.lora_operations.labels(kind).set(n)

    def count(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def observe_terminal(self, outcome: str, timings: Mapping[str, float], num_images: int = 0) -> None:
        """One request ended: its outcome and, when it ran, its latencies (the output's ``metrics`` in ms)."""
        self.count(outcome)
        if num_images:
            self.images.inc(num_images)
        if "steps_computed" in timings:
            self.cache_steps.labels("computed").inc(timings["steps_computed"])
            self.cache_steps.labels("skipped").inc(timings["steps_skipped"])
        if timings.get("result_cache_hit"):
            self.result_cache_hits.inc()
        if timings.get("preemptions"):
            self.preemptions.inc(timings["preemptions"])
        if outcome == "deadline_exceeded" and timings.get("exec_ms") == 0 and "queue_ms" in timings:
            self.deadline_queue_seconds.observe(timings["queue_ms"] / 1e3)
        for key, hist in (("queue_ms", self.queue_seconds), ("exec_ms", self.exec_seconds),
                          ("e2e_ms", self.e2e_seconds.labels(outcome))):
            if key in timings:
                hist.observe(timings[key] / 1e3)

    def observe_execute(self, batch_size: int, seconds: float, steps: int) -> None:
        """Engine execute observer (engine thread; prometheus-client is thread-safe)."""
        self.batch_size.observe(batch_size)
        self.step_seconds.observe(seconds / max(1, steps))

    # -- exposition -------------------------------------------------------------------------------------
    def render(self, stats: Mapping[str, Any]) -> bytes:
        """Refresh the scrape-time gauges from a ``/v1/stats`` snapshot and return the exposition text."""
        self.waiting.set(stats["waiting"])
        self.running.set(stats["running"])
        self.capacity.set(stats["capacity"])
        self.fleet.observe(stats)
        self.state.state(stats["state"])
        if "jobs" in stats:
            self.jobs_here.set(stats["jobs"]["here"])
            self.jobs_queued.set(stats["jobs"]["queued"])
            for status in STATUSES:
                self.jobs.labels(status).set(stats["jobs"][status])
        for worker in stats["workers"]:
            self.worker_alive.labels(str(worker["rank"])).set(1 if worker["alive"] else 0)
        self.compile.observe(stats.get("compile"))
        self.weights.observe(stats.get("weights"))
        self.sleep.observe(stats.get("sleep"))
        for rank_stats in stats.get("offload") or []:
            if rank_stats.get("mode", "none") == "none":
                continue
            rank = str(rank_stats["rank"])
            for tier, nbytes in rank_stats["resident_bytes"].items():
                self.offload_resident.labels(rank, tier).set(nbytes)
            self.offload_peak.labels(rank).set(rank_stats["peak_resident_bytes"])
            gathered = "world" in rank_stats                            # the gather tier (offload.mode distributed)
            for kind in ("loads", "releases", "evictions", "prefetches") + (("gathers",) if gathered else ()):
                self.offload_transfers.labels(rank, kind).set(rank_stats.get(kind, 0))
            if gathered:
                self.offload_shard.labels(rank).set(rank_stats["shard_bytes"])
                self.offload_gather.labels(rank, "total").set(rank_stats["gather_seconds"])
                self.offload_gather.labels(rank, "wait").set(rank_stats["gather_wait_seconds"])
        return generate_latest(self.registry)
