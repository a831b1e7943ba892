"""Rank-side code of the MMDiT (SD3, FLUX) parallel tests: CFG-parallel and joint Ulysses on real gloo ranks.

Reuses dist_rank_checks (adapter loading, the request/step scenarios, image comparison); adds the job that
also checks the joint Ulysses processors, and its own spawn (a spawned child imports this module by name).
"""

from __future__ import annotations

import traceback

import dist_rank_checks as checks

TIMEOUT_S = checks.TIMEOUT_S


def installed(denoiser) -> dict:
    """CFG forward wrapper present; how many attentions run the joint Ulysses processor."""
    from stage_runtime.distributed.ulysses_joint import JointUlyssesProcessor

    return {"cfg": getattr(denoiser, "_diffstage_cfg_parallel", None) is not None,
            "ulysses": sum(isinstance(getattr(m, "processor", None), JointUlyssesProcessor)
                           for m in denoiser.modules())}


def replaced_processor_error(adapter) -> str | None:
    """Put the first block's original processor back: the next denoiser call must refuse to run."""
    import torch

    attn = adapter.denoiser.transformer_blocks[0].attn
    attn.set_processor(attn.processor.original)
    try:
        with torch.inference_mode():
            checks.run_steps(adapter, [checks._request(adapter, "r", "1", 1, 0, 1.0)])
    except RuntimeError as exc:
        return str(exc)
    return None


def job(rank, groups, parallel, run) -> dict:
    from stage_runtime.distributed.apply import apply_parallelism

    payload = {}
    for kind, path in run["models"].items():
        adapter = checks.load_adapter(path)
        apply_parallelism(adapter, groups, parallel)
        payload[f"{kind}-installed"] = installed(adapter.denoiser)
        payload[kind], payload[f"{kind}-hook-calls"] = checks.counting_denoiser_hooks(adapter, checks.scenarios)
        if parallel.ulysses_degree > 1:
            payload[f"{kind}-replaced"] = replaced_processor_error(adapter)
    return payload


def run_rank(rank: int, world: int, rendezvous: list[str], runs: list[dict], results) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        from stage_runtime.config import ParallelConfig
        from stage_runtime.distributed.groups import destroy_distributed, init_distributed

        payloads = []
        for init_method, run in zip(rendezvous, runs, strict=True):
            parallel = ParallelConfig(**run["parallel"])
            groups = init_distributed(parallel, rank, init_method, torch.device("cpu"), TIMEOUT_S)
            try:
                payloads.append(job(rank, groups, parallel, run))
            finally:
                destroy_distributed()
        results.put((rank, "ok", payloads))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def Ranks(world: int, runs: list[dict]) -> checks.Ranks:  # noqa: N802 - a constructor, as dist_rank_checks.Ranks
    """``world`` spawned ranks running this module's :func:`run_rank` (the spawn and reaping are shared)."""
    return checks.Ranks(world, runs, target=run_rank)
