"""The warm-up marker (compilation/crash_guard.py): held and locked while a warm-up runs, gone when it ends; a
marker nobody holds means its warm-up died with its process; one another live process holds is a warm-up running
beside this one (another replica on the node), not a crash."""

from __future__ import annotations

import os

from stage_runtime.compilation.crash_guard import CrashGuard


def test_a_warm_up_that_ends_leaves_nothing(tmp_path):
    guard = CrashGuard(str(tmp_path), "model|regional|rank 0")
    assert not guard.previous_died()
    guard.hold()
    assert guard.path.read_text().startswith("model|regional|rank 0\npid ")
    guard.release()
    assert not guard.path.exists() and not CrashGuard(str(tmp_path), "model|regional|rank 0").previous_died()


def test_a_marker_held_by_a_live_warm_up_is_not_a_crash(tmp_path):
    running = CrashGuard(str(tmp_path), "k")
    running.hold()
    try:
        assert not CrashGuard(str(tmp_path), "k").previous_died()
        assert not CrashGuard(str(tmp_path), "another model").previous_died()
    finally:
        running.release()


def test_a_marker_nobody_holds_is_a_warm_up_that_died(tmp_path):
    dead = CrashGuard(str(tmp_path), "k")
    dead.hold()
    os.close(dead._fd)                 # what the kernel does for a process that dies: the lock goes, the file stays
    assert CrashGuard(str(tmp_path), "k").previous_died()
