"""StageMetrics (pure): its own registry, low-cardinality labels, values from observations and stats."""

from __future__ import annotations

from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from stage_runtime.serve.metrics import OUTCOMES, StageMetrics

STATS = {"state": "ready", "waiting": 3, "running": 2, "capacity": 4,
         "cost": {"outstanding": 4096 * 30, "completed_total": 4096 * 12, "rate": 512.0},
         "workers": [{"rank": 0, "pid": 10, "alive": True}, {"rank": 1, "pid": 11, "alive": False}]}


def samples(metrics: StageMetrics, stats=STATS) -> dict:
    text = metrics.render(stats).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_every_outcome_is_exported_from_the_start_and_counted():
    m = StageMetrics()
    m.observe_terminal("completed", {"queue_ms": 5.0, "exec_ms": 200.0, "e2e_ms": 205.0}, num_images=2)
    m.observe_terminal("aborted", {"queue_ms": 1.0, "exec_ms": 3.0, "e2e_ms": 4.0})
    m.count("rejected")
    got = samples(m)
    counts = {o: got[("diffstage_requests_total", (("outcome", o),))] for o in OUTCOMES}
    assert counts == {"completed": 1, "aborted": 1, "failed": 0, "dead": 0, "invalid": 0, "rejected": 1,
                      "unavailable": 0, "deadline_exceeded": 0}
    assert got[("diffstage_images_generated_total", ())] == 2
    assert got[("diffstage_request_e2e_seconds_count", (("outcome", "completed"),))] == 1
    assert got[("diffstage_request_e2e_seconds_count", (("outcome", "aborted"),))] == 1
    assert abs(got[("diffstage_request_e2e_seconds_sum", (("outcome", "completed"),))] - 0.205) < 1e-9
    assert got[("diffstage_request_exec_seconds_bucket", (("le", "0.25"),))] == 2


def test_deadline_outcomes_queue_time_and_preemptions_are_counted():
    m = StageMetrics()
    m.observe_terminal("deadline_exceeded", {"queue_ms": 700.0, "exec_ms": 0.0, "e2e_ms": 700.0})   # unrun
    m.observe_terminal("deadline_exceeded", {"queue_ms": 10.0, "exec_ms": 90.0, "e2e_ms": 100.0})   # stopped
    m.observe_terminal("completed", {"queue_ms": 1.0, "exec_ms": 50.0, "e2e_ms": 51.0, "preemptions": 2})
    got = samples(m)
    assert got[("diffstage_requests_total", (("outcome", "deadline_exceeded"),))] == 2
    assert got[("diffstage_request_deadline_queue_seconds_count", ())] == 1
    assert abs(got[("diffstage_request_deadline_queue_seconds_sum", ())] - 0.7) < 1e-9
    assert got[("diffstage_request_queue_seconds_count", ())] == 3
    assert got[("diffstage_preemptions_total", ())] == 2


def test_step_time_and_batch_size_from_the_execute_observer():
    m = StageMetrics()
    m.observe_execute(batch_size=4, seconds=0.5, steps=10)           # request mode: a wave of 10 steps
    m.observe_execute(batch_size=2, seconds=0.02, steps=1)           # step mode: one tick
    got = samples(m)
    assert got[("diffstage_denoise_step_seconds_count", ())] == 2
    assert abs(got[("diffstage_denoise_step_seconds_sum", ())] - 0.07) < 1e-9
    assert got[("diffstage_batch_size_sum", ())] == 6


def test_gauges_come_from_the_stats_snapshot_at_scrape_time():
    got = samples(StageMetrics())
    assert got[("diffstage_requests_waiting", ())] == 3 and got[("diffstage_requests_running", ())] == 2
    assert got[("diffstage_requests_capacity", ())] == 4
    assert got[("diffstage_worker_alive", (("rank", "0"),))] == 1
    assert got[("diffstage_worker_alive", (("rank", "1"),))] == 0
    assert got[("diffstage_stage_state", (("diffstage_stage_state", "ready"),))] == 1
    assert got[("diffstage_stage_state", (("diffstage_stage_state", "dead"),))] == 0


def test_registries_are_per_instance_and_never_global():
    a, b = StageMetrics(), StageMetrics()                  # would raise "Duplicated timeseries" if shared
    a.count("completed")
    assert samples(b)[("diffstage_requests_total", (("outcome", "completed"),))] == 0
    assert REGISTRY.get_sample_value("diffstage_requests_total", {"outcome": "completed"}) is None


def test_labels_stay_low_cardinality():
    m = StageMetrics()
    for i in range(50):
        m.observe_terminal("completed", {"e2e_ms": float(i)})
    labels = {k for fam in text_string_to_metric_families(m.render(STATS).decode())
              for s in fam.samples for k in s.labels}
    assert labels <= {"outcome", "le", "rank", "diffstage_stage_state"}


def test_cache_steps_and_result_cache_hits_are_counted():
    m = StageMetrics()
    assert samples(m)[("diffstage_cache_steps_total", (("outcome", "skipped"),))] == 0
    m.observe_terminal("completed", {"e2e_ms": 9.0, "steps_computed": 3, "steps_skipped": 17})
    m.observe_terminal("completed", {"e2e_ms": 0.1, "result_cache_hit": 1})
    got = samples(m)
    assert got[("diffstage_cache_steps_total", (("outcome", "computed"),))] == 3
    assert got[("diffstage_cache_steps_total", (("outcome", "skipped"),))] == 17
    assert got[("diffstage_result_cache_hits_total", ())] == 1


def test_dlo_ranks_export_their_shard_bytes_gathers_and_gather_seconds():
    dlo = {"mode": "distributed", "resident_bytes": {"cpu": 0, "peers": 1000}, "peak_resident_bytes": 700,
           "loads": 6, "releases": 6, "evictions": 0, "prefetches": 5, "world": 2, "shard_bytes": 512,
           "gathers": 12, "gather_seconds": 0.25, "gather_wait_seconds": 0.04}
    got = samples(StageMetrics(), {**STATS, "offload": [{**dlo, "rank": 0}, {**dlo, "rank": 1, "gathers": 11}]})
    assert got[("diffstage_offload_shard_bytes", (("rank", "1"),))] == 512
    assert got[("diffstage_offload_transfers", (("kind", "gathers"), ("rank", "1")))] == 11
    assert got[("diffstage_offload_gather_seconds", (("kind", "wait"), ("rank", "0")))] == 0.04
    assert got[("diffstage_offload_gather_seconds", (("kind", "total"), ("rank", "0")))] == 0.25
    layerwise = {k: v for k, v in dlo.items() if k not in ("world", "shard_bytes", "gathers", "gather_seconds",
                                                           "gather_wait_seconds")}
    got = samples(StageMetrics(), {**STATS, "offload": [{**layerwise, "mode": "layerwise", "rank": 0}]})
    assert not any(name.startswith("diffstage_offload_gather") or name == "diffstage_offload_shard_bytes"
                   for name, _ in got), "no DLO series without the gather tier"
