"""Rank processes for the parallel checks: one device each (``bench/gpu_smoke.py``, 2+ GPUs), all sharing one
device (``bench/gpu_check.py`` part 2), or CPU processes (gloo, the dry runs).

Ranks fork from the executor's fork server (``stage_runtime.executor.procs.worker_context``: torch and diffusers
imported once, no CUDA context before the fork), join a fresh world over a ``file://`` rendezvous with the given
backend, and put ``(rank, "ok", payload)`` or ``(rank, "error", message)`` on a queue. A rank that fails exits,
so its peers' collectives fail rather than wait; :func:`launch` kills whatever is still running at its timeout.
"""

from __future__ import annotations

import queue
import tempfile
import warnings

TOLERANCE = 2                 # uint8, parallel vs one rank (docs/testing.md, "Equal to diffusers")
PLANS_2 = {"cfg 2": {"cfg_parallel_size": 2}, "ulysses 2": {"ulysses_degree": 2}, "ring 2": {"ring_degree": 2},
           "tp 2": {"tensor_parallel_size": 2}}
PLANS_4 = {"ulysses 2 x ring 2": {"ulysses_degree": 2, "ring_degree": 2},
           "tp 2 x cfg 2": {"tensor_parallel_size": 2, "cfg_parallel_size": 2}}


def parallel_config(fields: dict):
    from stage_runtime.config import ParallelConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                  # tp without ulysses warns
        return ParallelConfig(**fields)


def rank_device(rank: int, placement: str):
    """``own``: cuda:<rank> (one GPU per rank); ``shared``: every rank on cuda:0; ``cpu``: the CPU."""
    import torch

    if placement == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", rank if placement == "own" else 0)


def scenario_images(adapter, steps: int = 3, size: int = 64) -> dict:
    """Request mode (two requests fused) and step mode (two requests batched) at the model's default guidance."""
    import torch

    from stage_runtime.request import DiffusionRequest, SamplingParams

    def req(rid, prompt, seed):
        sampling = SamplingParams(num_inference_steps=steps, seed=seed, height=size, width=size)
        return DiffusionRequest(rid, prompt, sampling).resolve(adapter.info())

    out = {}
    with torch.inference_mode():
        out.update({f"request/{k}": v for k, v in adapter.run_batch([req("a", "17", 1), req("b", "red", 2)]).items()})
        states = [adapter.prepare_encode(r) for r in (req("c", "3", 3), req("d", "cat", 4))]
        while active := [st for st in states if not st.finished]:
            for st, pred in zip(active, adapter.denoise_step(active), strict=True):
                adapter.noise_step(st, pred)
        out.update({f"step/{st.request_id}": adapter.post_decode(st) for st in states})
    return out


def load_adapter(path: str, device, dtype: str = "float32"):
    from stage_runtime.config import ModelConfig
    from stage_runtime.models.registry import resolve_adapter_class

    return resolve_adapter_class(ModelConfig(path=path)).load(path, device, dtype)


def model_ranks(rank: int, job: dict, results) -> None:
    """A rank's body: join the world, load each model with the plan applied, run the scenario, leave."""
    import torch

    from stage_runtime.distributed.apply import apply_parallelism
    from stage_runtime.distributed.groups import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    device, parallel = rank_device(rank, job["placement"]), parallel_config(job["plan"])
    try:
        groups = init_distributed(parallel, rank, job["rendezvous"], device, job.get("collective_timeout_s", 120.0),
                                  backend=job.get("backend"))
        try:
            out = {}
            for kind, path in job["models"].items():
                adapter = load_adapter(path, device, job.get("dtype", "float32"))
                apply_parallelism(adapter, groups, parallel)
                out[kind] = scenario_images(adapter)
            if job.get("extra"):                          # "module:function" (rank, device, groups, parallel, job)
                from stage_runtime.plugins import import_object

                out["extra"] = import_object(job["extra"])(rank, device, groups, parallel, job)
        finally:
            destroy_distributed()
        results.put((rank, "ok", out))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent; exiting releases the peers
        results.put((rank, "error", f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"))
        raise SystemExit(1) from None


def launch(world: int, job: dict, timeout_s: float, target=model_ranks) -> dict[int, tuple[str, object]]:
    """``world`` ranks of ``target(rank, job, results)`` forked from the fork server; rank → (status, payload).
    Ranks that have not answered by ``timeout_s`` are reported as ``("timeout", ...)`` and killed."""
    import time

    from stage_runtime.executor.procs import worker_context

    ctx = worker_context("forkserver")
    results = ctx.Queue()
    answers: dict[int, tuple[str, object]] = {}
    with tempfile.TemporaryDirectory(prefix="ds-gpu-ranks-") as folder:
        job = {**job, "rendezvous": f"file://{folder}/rendezvous"}
        procs = [ctx.Process(target=target, args=(r, job, results), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        try:
            while len(answers) < world and time.monotonic() < deadline:
                try:
                    rank, status, payload = results.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
                    answers[rank] = (status, payload)
                except queue.Empty:
                    if all(not p.is_alive() for p in procs) and results.empty():
                        break
        finally:
            for p in procs:
                p.join(timeout=10 if len(answers) == world else 0.1)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=10)
            results.close()
            results.join_thread()
    for rank, p in enumerate(procs):
        answers.setdefault(rank, ("timeout" if time.monotonic() >= deadline else "error",
                                  f"no answer within {timeout_s:.0f} s (exit code {p.exitcode})"))
    return answers


def worst_diff(answers: dict, references: dict) -> int:
    """The largest |rank image - one-rank image| over every rank, model and scenario image (uint8)."""
    import numpy as np

    return max(int(np.abs(out[kind][name].astype(np.int16) - ref.astype(np.int16)).max())
               for _, out in answers.values() for kind, images in references.items() for name, ref in images.items())


def errors(answers: dict) -> list[str]:
    return [f"rank {r}: {status}: {payload}" for r, (status, payload) in sorted(answers.items()) if status != "ok"]
