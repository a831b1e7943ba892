"""What the engine says about itself: its state, load and outcome counters, outstanding work, the requests in flight
(``/v1/stats``, ``/v1/requests``, ``/metrics``). A part of :class:`~stage_runtime.engine.engine.DiffusionEngine`
(its mixin); every read is one consistent snapshot under the engine's lock."""

from __future__ import annotations

from typing import Any

from stage_runtime.request import DiffusionRequest


class EngineIntrospection:
    @property
    def state(self) -> str:
        """dead (fail closed) → closed → ready (after warmup) → starting."""
        return ("dead" if self.dead_reason is not None else "closed" if self._closed
                else "ready" if self.ready else "starting")

    def stats(self) -> dict[str, int]:
        """Load and outcome counters in one consistent snapshot (``GET /v1/stats``)."""
        with self._lock:
            return {"waiting": self.scheduler.num_waiting_reqs, "running": self.scheduler.num_running_reqs,
                    "capacity": self.scheduler.max_num_running_reqs, **self.counters}

    def load_snapshot(self) -> dict[str, Any]:
        """Outstanding and completed work in pixel-steps, the completion rate, the waiting requests' adapters
        (``engine.cost_meter``: ``/v1/stats`` and ``/metrics``)."""
        with self._lock:
            return self.cost.snapshot(self.scheduler.live_states(list(self.outputs.streams)))

    def _live_requests(self) -> list[DiffusionRequest]:
        """The requests in flight (waiting, running, preempted); under the lock (the LoRA table's port)."""
        return [state.request for state in self.scheduler.live_states(list(self.outputs.streams))]

    def requests_snapshot(self) -> list[dict[str, Any]]:
        """In-flight requests with state and step progress (``GET /v1/requests``)."""
        with self._lock:
            return [state.snapshot() for state in self.scheduler.live_states(self.outputs.streams)]

    def num_request_states(self) -> int:
        """Per-request state held by the engine and its scheduler (0 when idle)."""
        with self._lock:
            return len(self.outputs.streams) + self.scheduler.num_states
