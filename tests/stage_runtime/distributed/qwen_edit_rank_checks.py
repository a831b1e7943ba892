"""Rank-side code of the Qwen-Image-Edit CFG-parallel test: edit scenarios on the tiny Qwen-Image-Edit and
Edit-Plus, on real gloo ranks and (for the references) on one plain rank. Reuses dist_rank_checks (adapter
loading, the step loop, hook counting, the spawn); adds the edits and its own job (a spawned child imports
this module by name)."""

from __future__ import annotations

import dist_rank_checks as checks

SIDE = 64


def _edit(adapter, rid: str, prompt: str, steps: int, seed: int, guidance: float, n: int = 1):
    """An edit of the family's pictures: one (Edit) or two of other sizes (Edit-Plus), at 64x64."""
    import numpy as np

    from stage_runtime.request import DiffusionRequest, EditInput, SamplingParams

    info = adapter.info()
    first = checks.picture(SIDE)
    more = (np.ascontiguousarray(checks.picture(48)[::-1]),) if info.max_edit_images > 1 else ()
    sampling = SamplingParams(num_inference_steps=steps, seed=seed, guidance_scale=guidance, num_outputs=n,
                              height=SIDE, width=SIDE)
    return DiffusionRequest(rid, prompt, sampling, edit=EditInput(first, more_images=more)).resolve(info)


def scenarios(adapter) -> dict:
    """Images keyed ``<scenario>/<request id>``: a request-mode wave of two guided edits (4 rows: 2 a rank), then
    the step loop with a guided 2-image request and an unguided one of 3 steps batched (5 rows: padded to 3 a
    rank; then 1 row, computed whole on each rank)."""
    import torch

    out: dict = {}
    with torch.inference_mode():
        wave = [_edit(adapter, "a", "make it blue", 2, 1, 4.0), _edit(adapter, "b", "a red car", 2, 2, 4.0)]
        for rid, img in adapter.run_batch(wave).items():
            out[f"request-g4/{rid}"] = img
        steps = [_edit(adapter, "s3", "make it snow", 3, 4, 1.0), _edit(adapter, "s2", "a cat", 2, 5, 4.0, n=2)]
        for rid, img in checks.run_steps(adapter, steps).items():
            out[f"step-mixed/{rid}"] = img
    return out


def job(rank, groups, parallel, run) -> dict:
    from stage_runtime.distributed.apply import apply_parallelism

    payload = {}
    for kind, path in run["models"].items():
        adapter = checks.load_adapter(path)
        apply_parallelism(adapter, groups, parallel)
        payload[f"{kind}-installed"] = checks.installed(adapter.denoiser)
        payload[kind], payload[f"{kind}-hook-calls"] = checks.counting_denoiser_hooks(adapter, scenarios)
    return payload


JOBS = {"models": job}


def Ranks(world: int, runs: list[dict]) -> checks.Ranks:  # noqa: N802 - a constructor, as dist_rank_checks.Ranks
    """``world`` spawned ranks running this module's :func:`job` for every run (spawn and reaping are shared)."""
    return checks.Ranks(world, [{**run, "job": "models"} for run in runs], jobs_module=__name__)
