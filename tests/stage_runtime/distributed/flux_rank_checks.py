"""Rank-side code of the FLUX.1 CFG-parallel test (test_flux_cfg_parallel.py): the scenarios each rank and the
single-rank reference run, and the job the spawned ranks run (a spawned child imports this module by name)."""

from __future__ import annotations

import dist_rank_checks as checks

TRUE_CFG = {"negative_prompt": "blurry", "true_cfg_scale": 4.0}


def _request(adapter, rid: str, prompt: str, steps: int, seed: int, n: int = 1, inpaint: bool = False, side: int = 64,
             **kw):
    import numpy as np

    from stage_runtime.request import DiffusionRequest, EditInput, SamplingParams

    edit = None
    if inpaint:
        mask = np.zeros((64, 64), np.uint8)
        mask[16:48, 8:40] = 255
        edit = EditInput(checks.picture(64), mask, 0.8)
    sampling = SamplingParams(num_inference_steps=steps, seed=seed, height=side, width=side, num_outputs=n, **kw)
    return DiffusionRequest(rid, prompt, sampling, edit=edit).resolve(adapter.info())


def scenarios(adapter) -> dict:
    """Every image compared, keyed ``<scenario>/<request id>``: a request-mode true-CFG wave (its step loop: 6 rows
    a forward), a plain pipeline call (3 rows: a padded split), one true-CFG request (its two halves on the two
    ranks), a true-CFG inpaint, 16 rows of 16 image tokens (16x16 px: the position ids have as many rows as the
    forward, and must not be split), and step mode with a true-CFG and a plain request of other step counts."""
    import torch

    out: dict = {}
    with torch.inference_mode():
        runs = {
            "request-cfg": [_request(adapter, "a", "a cat", 2, 1, **TRUE_CFG),
                            _request(adapter, "b", "a red car", 2, 2, n=2, **TRUE_CFG)],
            "request-plain": [_request(adapter, "a", "a cat", 2, 1), _request(adapter, "b", "a red car", 2, 2, n=2)],
            "request1-cfg": [_request(adapter, "c", "a tree", 2, 3, **TRUE_CFG)],
            "inpaint-cfg": [_request(adapter, "d", "a fox", 3, 4, inpaint=True, **TRUE_CFG)],
            "tokens-as-rows": [_request(adapter, "e", "a cat", 1, 7, n=8, side=16, **TRUE_CFG)],
        }
        for name, batch in runs.items():
            for rid, image in adapter.run_batch(batch).items():
                out[f"{name}/{rid}"] = image
        steps = [_request(adapter, "s3", "a dog", 3, 5, **TRUE_CFG), _request(adapter, "s2", "a cat", 2, 6, n=2)]
        for rid, image in checks.run_steps(adapter, steps).items():
            out[f"step/{rid}"] = image
    return out


def job(rank, groups, parallel, run) -> dict:
    from stage_runtime.distributed.apply import apply_parallelism

    adapter = checks.load_adapter(run["path"])
    apply_parallelism(adapter, groups, parallel)
    images, calls = checks.counting_denoiser_hooks(adapter, scenarios)
    return {"installed": getattr(adapter.denoiser, "_diffstage_cfg_parallel", None) is not None, "images": images,
            "hook-calls": calls}


JOBS = {"flux": job}
