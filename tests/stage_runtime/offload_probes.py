"""Observation helpers for the offload tests: they measure real storages, files and mappings; they replace nothing."""

from __future__ import annotations

import os

import numpy as np
import torch

from stage_runtime.config import load_config
from stage_runtime.request import DiffusionRequest, SamplingParams
from stage_runtime.scheduler_output import NewRequestData, SchedulerOutput
from stage_runtime.worker.model_runner import DiffusionModelRunner


def make_runner(path: str, offload: dict | None = None) -> DiffusionModelRunner:
    config = load_config({"model": {"path": path}, "device": "cpu", "offload": offload or {}})
    runner = DiffusionModelRunner(config, torch.device("cpu"))
    runner.load_model()
    return runner


def req(rid: str, prompt: str = "a red cat", steps: int = 3, seed: int = 1, **kw) -> DiffusionRequest:
    return DiffusionRequest(rid, prompt, SamplingParams(num_inference_steps=steps, seed=seed, **kw))


def run_request(runner: DiffusionModelRunner, request: DiffusionRequest) -> np.ndarray:
    """Request mode: one pipeline call; returns the request's images."""
    wave = SchedulerOutput(step_id=1, scheduled_new_reqs=[NewRequestData(request.request_id,
                                                                        request.resolve(runner.model_info))])
    out = runner.execute_model(wave).get(request.request_id)
    assert out.error is None, out.error
    return out.images


def module_components(runner) -> dict[str, torch.nn.Module]:
    return {n: c for n, c in runner.adapter.pipe.components.items() if isinstance(c, torch.nn.Module)}


def materialised_bytes(modules) -> int:
    """Bytes the modules' parameters and buffers hold right now: distinct storages, actual sizes."""
    seen: dict[int, int] = {}
    for module in modules:
        for t in [*module.parameters(), *module.buffers()]:
            st = t.untyped_storage()
            if st.nbytes():
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Bitwise copies of every parameter and buffer, by qualified name."""
    return {name: t.detach().clone() for name, t in [*module.named_parameters(), *module.named_buffers()]}


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().flatten().view(torch.uint8),
                                                                      b.contiguous().flatten().view(torch.uint8))


def open_fds() -> dict[str, str]:
    """This process's open descriptors → what each points at (a vanished one is left out)."""
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:                  # closed between the listing and the look (the listing's own, or another's)
            continue
    return fds


def fds_opened_since(before: dict[str, str]) -> dict[str, str]:
    """Descriptors open now that were not open (to the same file) at ``before``. Only what was opened counts: the
    process is a shared test worker, where the collector may close an earlier test's files meanwhile."""
    return {fd: target for fd, target in open_fds().items() if before.get(fd) != target}


def offload_mappings() -> list[str]:
    """Memory mappings of offload files (unlinked files still show, marked '(deleted)')."""
    with open("/proc/self/maps", encoding="utf-8") as f:
        return [line for line in f if "diffstage-offload-" in line]


def max_diff(a: np.ndarray, b: np.ndarray) -> int:
    assert a.shape == b.shape
    return int(np.abs(a.astype(int) - b.astype(int)).max())


def run_steps(runner: DiffusionModelRunner, request: DiffusionRequest) -> np.ndarray:
    """Step mode driven as the step scheduler does: the payload once, then the id, tick by tick."""
    rid = request.request_id
    tick = SchedulerOutput(step_id=1, scheduled_new_reqs=[NewRequestData(rid, request.resolve(runner.model_info))],
                           mode="step")
    for step in range(2, 1000):
        out = runner.execute_model(tick).get(rid)
        assert out.error is None, out.error
        if out.finished:
            return out.images
        tick = SchedulerOutput(step_id=step, scheduled_cached_req_ids=[rid], mode="step")
    raise AssertionError("request never finished")


def rss_bytes() -> int:
    with open("/proc/self/statm", encoding="utf-8") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
