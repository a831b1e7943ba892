"""The families the fleet routes and scales on, read at scrape time (docs/http-api.md#get-metrics):

- the inference gateway's model-server contract (the endpoint picker's ``engineConfigs`` maps them; the
  operator labels stage pods ``llm-d.ai/engine-type: diffstage``): waiting and running come from
  ``StageMetrics``; here the 0–1 utilisation (running ÷ ``max_num_seqs``, the picker's ``kvUsageSpec``, so its
  default flow control reads a stage with free batch slots as unsaturated) and the LoRA gauge in the shape its
  LoRA-affinity scorer reads: one series, labels ``running_lora_adapters`` (the adapters resident on this
  replica, comma-separated: a request naming one runs without a load), ``waiting_lora_adapters`` (those the
  waiting requests name) and ``max_lora`` (``max_loras``), its value the Unix time its labels last changed
  (the picker takes the series with the largest value);
- the diffusion cost signal (``engine.cost_meter``): outstanding pixel-steps, pixel-steps done (a counter)
  and done per second lately — what ``spec.autoscaling.metric: cost`` and a KEDA trigger scale on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "diffstage_"
LORA_LABELS = ("running_lora_adapters", "waiting_lora_adapters", "max_lora")


class FleetCollector(Collector):
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._stats: Mapping[str, Any] = {"running": 0, "capacity": 0,
                                          "cost": {"outstanding": 0, "completed_total": 0, "rate": 0.0}}
        self._lora: tuple[str, str, str] | None = None      # the LoRA gauge's label values; None: no adapters
        self._lora_since = 0.0

    def observe(self, stats: Mapping[str, Any]) -> None:
        """A ``/v1/stats`` snapshot (``running``, ``capacity``, ``cost``), at scrape time."""
        self._stats = stats

    def observe_loras(self, resident: Sequence[str], waiting: Sequence[str], max_loras: int) -> None:
        labels = (",".join(resident), ",".join(waiting), str(max_loras))
        if labels != self._lora:
            self._lora, self._lora_since = labels, self._clock()

    def collect(self) -> Iterator[Metric]:
        stats, cost = self._stats, self._stats["cost"]
        capacity = stats["capacity"]
        yield GaugeMetricFamily(f"{PREFIX}batch_utilization_ratio", "Batch slots in use, 0-1: running requests / "
                                "max_num_seqs (the endpoint picker's kvUsageSpec)",
                                value=min(1.0, stats["running"] / capacity) if capacity else 0.0)
        yield GaugeMetricFamily(f"{PREFIX}cost_outstanding_pixel_steps", "Work left in the requests in flight: "
                                "remaining denoising steps x pixels x frames x outputs, summed over waiting and "
                                "running", value=cost["outstanding"])
        yield CounterMetricFamily(f"{PREFIX}cost_completed_pixel_steps", "Work done: denoising steps run x pixels x "
                                  "frames x outputs (rate() is the completion rate)", value=cost["completed_total"])
        yield GaugeMetricFamily(f"{PREFIX}cost_completion_rate_pixel_steps_per_second", "Pixel-steps done per second "
                                "over the last minute of reads", value=cost["rate"])
        info = GaugeMetricFamily(f"{PREFIX}lora_requests_info", "LoRA adapters for the endpoint picker: resident "
                                 "(running_lora_adapters), named by waiting requests, max_loras; the value is the "
                                 "Unix time the labels last changed", labels=LORA_LABELS)
        if self._lora is not None:
            info.add_metric(list(self._lora), self._lora_since)
        yield info
