"""Helpers for tests that run the multiprocess executor (they observe real processes; they replace nothing)."""

from __future__ import annotations

import multiprocessing
import os
import time


from stage_runtime.config import load_config
from stage_runtime.engine.engine import DiffusionEngine
from stage_runtime.executor import shm
from stage_runtime.process_tree import proc_stat
from stage_runtime.request import DiffusionRequest, SamplingParams


def mp_engine(path: str, parallel: dict | None = None, adapter: str | None = None, executor_class=None,
              start_method: str = "forkserver", **scheduler) -> DiffusionEngine:
    config = load_config({"model": {"path": path, "adapter": adapter}, "device": "cpu", "executor": "mp",
                          "warmup": False, "parallel": parallel or {}, "scheduler": scheduler,
                          "worker_start_method": start_method})
    kwargs = {} if executor_class is None else {"executor_class": executor_class}
    return DiffusionEngine.make_engine(config, **kwargs)


def req(rid: str, prompt: str = "a red cat", steps: int = 3, seed: int = 0, **kw) -> DiffusionRequest:
    return DiffusionRequest(rid, prompt, SamplingParams(num_inference_steps=steps, seed=seed, **kw))


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a process that exits while we read is gone)."""
    stat = proc_stat(pid)
    return stat is not None and stat[1] != "Z"


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until none of ``pids`` is alive; returns the survivors."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.02)
    return [p for p in pids if pid_alive(p)]


def segments(prefix: str) -> list[str]:
    return sorted(p.name for p in shm.SHM_DIR.glob(f"{prefix}*"))


def assert_released(engine: DiffusionEngine) -> None:
    """After close: no rank process, no shared-memory segment, no socket folder."""
    ex = engine.executor
    assert wait_gone([p.pid for p in ex.procs], 10) == []
    assert segments(ex.shm_prefix) == []
    assert not os.path.exists(ex._ipc_dir)
    assert not [c for c in multiprocessing.active_children() if c.pid in {p.pid for p in ex.procs}]
