"""StepWatchdog: a running call with no progress past stall_unready_s is stalled (named requests, step);
progress clears it; past stall_fail_s it fails once; an idle engine never stalls. A hand-driven clock."""

from __future__ import annotations

import pytest

from stage_runtime.config import LimitsConfig, load_config
from stage_runtime.engine.watchdog import StepWatchdog
from stage_runtime.errors import ConfigError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def watchdog(unready=10.0, fail=30.0):
    clock, failures = Clock(), []
    return StepWatchdog(LimitsConfig(stall_unready_s=unready, stall_fail_s=fail), failures.append, clock), clock, failures


def test_an_idle_engine_never_stalls():
    dog, clock, failures = watchdog()
    clock.now += 10_000
    assert dog.stalled() is None and dog.stalled_for() == 0.0 and not dog.check() and failures == []


def test_no_progress_past_the_unready_bound_is_stalled_and_names_the_requests_and_the_step():
    dog, clock, failures = watchdog()
    dog.begin(["a", "b"])
    dog.progress(3, 50)
    clock.now += 9.9
    assert dog.stalled() is None
    clock.now += 0.2
    assert dog.stalled() == "no step progress for 10 s (requests a, b, in step 4 of 50)"
    assert not dog.check() and failures == []            # unready is not failed


def test_progress_clears_a_stall_and_the_end_of_the_call_too():
    dog, clock, _ = watchdog()
    dog.begin(["a"])
    clock.now += 11
    assert dog.stalled() is not None
    dog.progress(1, 2)
    assert dog.stalled() is None
    clock.now += 11
    assert dog.stalled().endswith("(requests a, in step 2 of 2)")
    dog.end()
    assert dog.stalled() is None and dog.running() == ()


def test_past_the_fail_bound_it_fails_closed_exactly_once():
    dog, clock, failures = watchdog()
    dog.begin(["a"])
    clock.now += 30
    assert dog.check() and dog.check()
    assert failures == ["no step progress for 30 s (requests a, in a step); past stall_fail_s=30 the replica "
                        "fails closed"]


def test_a_decode_after_the_last_step_is_named_as_such():
    dog, clock, _ = watchdog()
    dog.begin(["v"])
    dog.progress(8, 8)
    clock.now += 12
    assert dog.stalled().endswith("(requests v, after its last step (decoding))")


@pytest.mark.parametrize("phase, where", [("encode", "encoding the prompt, before step 1"),
                                          ("decode", "after its last step (decoding)"),
                                          ("denoise", "in step 3 of 8")])
def test_the_phase_a_call_reported_last_names_where_it_is_stuck(phase, where):
    dog, clock, _ = watchdog()
    dog.begin(["v"])
    dog.progress(8 if phase == "decode" else 2 if phase == "denoise" else 0, 8, phase)
    clock.now += 12
    assert dog.stalled().endswith(f"(requests v, {where})")


def test_off_bounds_never_fire():
    dog, clock, failures = watchdog(unready=None, fail=None)
    dog.begin(["a"])
    clock.now += 1e6
    assert dog.stalled() is None and not dog.check() and failures == []


def test_the_fail_bound_must_be_longer_than_the_unready_bound():
    with pytest.raises(ConfigError, match=r"limits.*stall_fail_s=60 must be longer than stall_unready_s=120"):
        load_config({"model": {"path": "/m"}, "limits": {"stall_fail_s": 60}})
