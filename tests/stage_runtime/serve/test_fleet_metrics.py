"""The fleet families on a StageMetrics registry (pure): the 0-1 utilisation, the cost signal, and the LoRA gauge in
the shape the endpoint picker's LoRA-affinity scorer reads (one series; its value moves when its labels change)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from stage_runtime.serve.fleet_metrics import FleetCollector
from stage_runtime.serve.metrics import StageMetrics


def stats(running: int, capacity: int, outstanding: int = 0, completed: int = 0, rate: float = 0.0) -> dict:
    return {"state": "ready", "waiting": 0, "running": running, "capacity": capacity, "workers": [],
            "cost": {"outstanding": outstanding, "completed_total": completed, "rate": rate}}


def families(metrics: StageMetrics, snapshot: dict) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.render(snapshot).decode())}


def test_utilisation_is_running_over_capacity_between_0_and_1():
    m = StageMetrics()
    assert families(m, stats(0, 4))["diffstage_batch_utilization_ratio"].samples[0].value == 0.0
    assert families(m, stats(3, 4))["diffstage_batch_utilization_ratio"].samples[0].value == 0.75
    assert families(m, stats(4, 4))["diffstage_batch_utilization_ratio"].samples[0].value == 1.0
    assert families(m, stats(0, 0))["diffstage_batch_utilization_ratio"].samples[0].value == 0.0   # starting


def test_the_cost_signal_is_a_gauge_a_counter_and_a_rate_in_pixel_steps():
    got = families(StageMetrics(), stats(1, 4, outstanding=4096 * 40, completed=4096 * 9, rate=2048.0))
    assert got["diffstage_cost_outstanding_pixel_steps"].type == "gauge"
    assert got["diffstage_cost_outstanding_pixel_steps"].samples[0].value == 4096 * 40
    completed = got["diffstage_cost_completed_pixel_steps"]
    assert completed.type == "counter" and completed.samples[0].name == "diffstage_cost_completed_pixel_steps_total"
    assert completed.samples[0].value == 4096 * 9
    assert got["diffstage_cost_completion_rate_pixel_steps_per_second"].samples[0].value == 2048.0


def test_the_lora_gauge_is_one_series_whose_value_moves_only_when_its_labels_change():
    now = [1000.0]
    fleet = FleetCollector(clock=lambda: now[0])
    assert [s for f in fleet.collect() if f.name == "diffstage_lora_requests_info" for s in f.samples] == []
    fleet.observe_loras(["ink", "pixel"], ["ink"], 8)
    now[0] = 1005.0
    fleet.observe_loras(["ink", "pixel"], ["ink"], 8)                   # unchanged: the value stays
    [info] = [f for f in fleet.collect() if f.name == "diffstage_lora_requests_info"]
    [sample] = info.samples
    assert sample.labels == {"running_lora_adapters": "ink,pixel", "waiting_lora_adapters": "ink", "max_lora": "8"}
    assert sample.value == 1000.0
    fleet.observe_loras(["ink"], [], 8)
    [sample] = [s for f in fleet.collect() if f.name == "diffstage_lora_requests_info" for s in f.samples]
    assert sample.labels["running_lora_adapters"] == "ink" and sample.value == 1005.0


def test_a_model_without_lora_support_exports_no_lora_series():
    m = StageMetrics()
    m.observe_loras({"resident": 0, "requests_by_adapter": {}, "operations": {}, "names": [], "max_loras": 8,
                     "serves_loras": False})
    assert families(m, stats(0, 1))["diffstage_lora_requests_info"].samples == []
