"""Data-parallel placement: least-loaded replica, sticky until finished, nothing kept afterwards."""

from __future__ import annotations

import pytest

from stage_runtime.executor.placement import DataParallelPlacement
from stage_runtime.outputs import BatchRunnerOutput, RunnerOutput
from stage_runtime.request import DiffusionRequest, SamplingParams
from stage_runtime.scheduler_output import NewRequestData, SchedulerOutput


def out(step: int, new=(), cached=(), finished=(), mode="step") -> SchedulerOutput:
    reqs = [NewRequestData(r, DiffusionRequest(r, "x", SamplingParams())) for r in new]
    return SchedulerOutput(step, reqs, list(cached), set(finished), mode=mode)


def test_single_replica_places_nothing():
    p = DataParallelPlacement(1)
    assert p.place(out(1, new=["a", "b"])) is None and len(p) == 0


@pytest.mark.parametrize(("replicas", "expected"), [(2, [0, 1, 0, 1, 0]), (3, [0, 1, 2, 0, 1])])
def test_new_requests_spread_over_the_least_loaded_replicas(replicas, expected):
    p = DataParallelPlacement(replicas)
    ids = [f"r{i}" for i in range(5)]
    assert p.place(out(1, new=ids)) == dict(zip(ids, expected, strict=True))


def test_step_mode_requests_stay_on_their_replica_until_they_finish():
    p = DataParallelPlacement(2)
    first = out(1, new=["a", "b"])
    assert p.place(first) == {"a": 0, "b": 1}
    p.release(first, BatchRunnerOutput.of(RunnerOutput("a", finished=False), RunnerOutput("b", finished=True)))
    assert p.replica_of == {"a": 0}
    second = out(2, new=["c", "d"], cached=["a"])
    assert p.place(second) == {"c": 1, "d": 0, "a": 0}       # c fills replica 1, then ties go low
    p.release(second, BatchRunnerOutput.of(RunnerOutput("a", error="boom"), RunnerOutput("c", aborted=True),
                                           RunnerOutput("d", finished=False)))
    assert p.replica_of == {"d": 0}
    p.place(out(3, finished=["d"]))                           # aborted between ticks
    assert len(p) == 0


def test_request_mode_releases_every_request_after_its_wave():
    p = DataParallelPlacement(2)
    wave = out(1, new=["a", "b"], mode="request")
    p.place(wave)
    p.release(wave, BatchRunnerOutput())
    assert len(p) == 0
